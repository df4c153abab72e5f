"""A/A copies of drafters: `NAME~` is drafter NAME whose history already holds one earlier output, an
unrelated text. No method gains from it; it only moves the drafter's state off the original's. The drafters
of a benchmark carry state from prompt to prompt (their history of outputs, calibrations, the recycling
table), and two drafters whose states differ at all draft differently from then on: the spread between
NAME and NAME~ is how far a method's figures move with that state alone, the yardstick for any difference
between two methods on the same prompts (BENCHMARKS.md section 6, "A/A").

    python -m specedge.bench.perturbed bench ... --drafters retrieval,hybrid,retrieval~   (specedge bench)
"""

from __future__ import annotations

import sys

from specedge.edge.drafter import Drafter

MARK = "~"
# One earlier output: an unrelated text, no Spec-Bench prompt's answer
EARLIER = ("The committee met on Tuesday to discuss the budget for the next year. After a long debate, the members "
           "agreed to increase funding for schools and roads, while cutting administrative costs by ten percent.")


def perturb(drafter: Drafter, tokenizer) -> Drafter:
    """`drafter` after one generation that wrote EARLIER (no verifier: the output is put in its history)."""
    ids = tokenizer.encode(EARLIER)
    sources = getattr(drafter, "sources", (drafter,))  # a hybrid: its retrieval keeps the history
    retrieval = sources[0]
    if not hasattr(retrieval, "history"):
        raise ValueError("an A/A copy is made of a drafter with retrieval (retrieval, hybrid)")
    retrieval.begin(ids[:8])
    retrieval.index.append(ids[8:])
    retrieval.end()
    return drafter


def install() -> None:
    """Make the drafter registry understand `NAME~` (for `specedge bench` run through this module)."""
    import specedge.edge.registry as registry

    make, check = registry.make_drafter, registry.check_drafter

    def make_drafter(name: str, *args, **kwargs):
        if not name.endswith(MARK):
            return make(name, *args, **kwargs)
        if kwargs.get("tokenizer") is None:
            raise ValueError(f"{name}: an A/A copy needs the target's tokenizer")
        return perturb(make(name.removesuffix(MARK), *args, **kwargs), kwargs["tokenizer"])

    registry.make_drafter = make_drafter
    registry.check_drafter = lambda name, *args, **kwargs: check(name.removesuffix(MARK), *args, **kwargs)


if __name__ == "__main__":
    install()
    from specedge.cli import main

    sys.exit(main())
