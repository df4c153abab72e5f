"""Fuzzing the verifier's Session protocol over real gRPC (tiny model, token ids).

Two kinds of hostile traffic, CI-sized (> 10,000 malformed requests in all), while honest clients keep
generating on the same verifier:
- structured: a valid session with one defect drawn by hypothesis (a bad field in any message, messages
  out of order); each defect has the status it must get, which is checked;
- mutated: the bytes of valid traffic flipped, cut, repeated or spliced with noise on the wire; any answer
  but a crash will do: OK where the bytes still make a valid session, else a client error.
Never INTERNAL or UNKNOWN, the status message always short, no KV block leaked, the verifier healthy, and
the honest clients' outputs exactly their solo outputs.
"""

from __future__ import annotations

import os
import random
import threading
from collections import Counter

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_grpc import PROMPT, V, healthy, solo_output, tiny_verifier

from specedge.common.params import SamplingParams
from specedge.protos import verifier_pb2 as pb

MAX_TREE, MAX_NEW = 32, 256  # tiny_verifier's limits
CLIENT_ERRORS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
                 grpc.StatusCode.RESOURCE_EXHAUSTED}
STRUCTURED_EXAMPLES = int(os.environ.get("FUZZ_STRUCTURED", 2_000))
MUTATED_STREAMS = int(os.environ.get("FUZZ_MUTATED", 8_000))  # with the structured ones, 10,000 per run
MUTATING_THREADS = 4
INVALID, PRECONDITION = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION

in_vocab = st.integers(0, V - 1)
out_of_vocab = st.one_of(st.integers(V, 2**31 - 1), st.integers(-(2**31), -1))
f32 = st.floats(width=32)  # the wire's floats are 32-bit: 1 + 1e-12 would arrive as a valid 1.0
not_a_probability = f32.filter(lambda x: not 0 <= x <= 1)


@pytest.fixture(scope="module")
def verifier():
    with tiny_verifier() as s:
        yield s


@pytest.fixture(scope="module")
def session_call(verifier):
    channel = grpc.insecure_channel(verifier.target)
    call = channel.stream_stream("/specedge.v1.Verifier/Session")  # raw bytes both ways
    yield call
    channel.close()


def run_stream(call, messages: list[bytes]) -> tuple[grpc.StatusCode, str]:
    try:
        for _ in call(iter(messages), timeout=30):
            pass
    except grpc.RpcError as e:
        return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


def chain(depth: int, start: int = 1) -> pb.DraftTree:
    return pb.DraftTree(tokens=[(start + i) % V for i in range(depth)], parents=list(range(-1, depth - 1)))


def open_msg(**fields) -> pb.SessionRequest:
    params = fields.pop("params", pb.SamplingParams(max_new_tokens=64))  # more than the rounds before a defect
    return pb.SessionRequest(open=pb.OpenSession(prompt_ids=fields.pop("prompt_ids", PROMPT), params=params, **fields))


def draft_msg(tree: pb.DraftTree) -> pb.SessionRequest:
    return pb.SessionRequest(draft=tree)


CLOSE = pb.SessionRequest(close=pb.CloseSession())


# ---- structured defects: (messages, the status they must get) ------------------------------------------


@st.composite
def bad_prompt(draw):
    kind = draw(st.sampled_from(["token", "empty", "long"]))
    if kind == "token":
        prompt = draw(st.lists(in_vocab, min_size=1, max_size=40))
        prompt.insert(draw(st.integers(0, len(prompt))), draw(out_of_vocab))
    else:
        prompt = [] if kind == "empty" else [1] * draw(st.integers(8193, 9000))
    return [open_msg(prompt_ids=prompt)], INVALID


@st.composite
def bad_params(draw):
    field, value = draw(st.one_of(
        st.tuples(st.just("temperature"), st.one_of(st.floats(max_value=-0.5, width=32), st.just(float("nan")),
                                                    st.just(float("inf")))),
        st.tuples(st.just("top_p"), st.one_of(st.floats(min_value=1.5, width=32),
                                              st.floats(max_value=-0.5, width=32), st.just(float("nan")))),
        st.tuples(st.just("top_k"), st.integers(-(2**31), -1)),
        st.tuples(st.just("max_new_tokens"), st.one_of(st.integers(MAX_NEW + 1, 2**31 - 1),
                                                       st.integers(-(2**31), -1))),
    ))
    return [open_msg(params=pb.SamplingParams(**{field: value}))], INVALID


@st.composite
def bad_tree(draw) -> pb.DraftTree:
    """A draft tree that breaks exactly one rule of the validator."""
    n = draw(st.integers(1, 12))
    tree = chain(n, draw(in_vocab))
    i = draw(st.integers(0, n - 1))
    kind = draw(st.sampled_from(["parent", "token", "lengths", "siblings", "size", "estimate", "estimates",
                                 "proposal"]))
    if kind == "parent":
        tree.parents[i] = draw(st.one_of(st.integers(i, 2**31 - 1), st.integers(-(2**31), -2)))
    elif kind == "token":
        tree.tokens[i] = draw(out_of_vocab)
    elif kind == "lengths":
        tree.parents.append(-1)
    elif kind == "siblings":
        tree.tokens.append(tree.tokens[0])
        tree.parents.append(-1)
    elif kind == "size":
        tree.CopyFrom(chain(draw(st.integers(MAX_TREE + 1, 200))))
    elif kind == "estimate":
        tree.accept_probs.extend([0.5] * n)
        tree.accept_probs[i] = draw(not_a_probability)
    elif kind == "estimates":
        tree.accept_probs.extend([0.5] * draw(st.integers(1, 40).filter(lambda k: k != n)))
    else:
        probs = draw(st.sampled_from([[float("nan"), 1.0], [float("inf"), 0.0], [0.3, 0.3], [-0.5, 1.5]]))
        tree.proposals.add(parent=-1, token_ids=[tree.tokens[0], (tree.tokens[0] + 1) % V], probs=probs)
    return tree


@st.composite
def bad_draft(draw):
    """A valid open, some valid rounds, then a bad tree (or the bad tree inside the open itself)."""
    tree = draw(bad_tree())
    if draw(st.booleans()):
        return [open_msg(draft=tree)], INVALID
    rounds = [draft_msg(chain(draw(st.integers(0, 4)))) for _ in range(draw(st.integers(0, 3)))]
    return [open_msg(), *rounds, draft_msg(tree)], INVALID


@st.composite
def bad_root(draw):
    rounds = draw(st.integers(0, 3))
    length = draw(st.one_of(st.integers(1, len(PROMPT) - 1), st.integers(len(PROMPT) + 4 * rounds + 2, 2**31 - 1),
                            st.integers(-(2**31), -1)))
    tree = chain(2)
    tree.root_length = length
    return [open_msg(), *[draft_msg(pb.DraftTree()) for _ in range(rounds)], draft_msg(tree)], INVALID


@st.composite
def bad_order(draw):
    kind = draw(st.sampled_from(["draft first", "close first", "open twice", "empty", "after close"]))
    return {
        "draft first": [draft_msg(chain(2))],
        "close first": [CLOSE],
        "open twice": [open_msg(), open_msg()],
        "empty": [open_msg(), pb.SessionRequest()],
        "after close": [open_msg(), CLOSE, draw(st.sampled_from([draft_msg(chain(1)), open_msg(), CLOSE]))],
    }[kind], INVALID


@st.composite
def bad_strings(draw):
    kind = draw(st.sampled_from(["long id", "control id", "fingerprint"]))
    if kind == "long id":
        return [open_msg(client_id=draw(st.text(min_size=129, max_size=5000)))], INVALID
    if kind == "control id":
        text = draw(st.text(max_size=20))
        return [open_msg(client_id=text + draw(st.sampled_from("\n\r\t\x00\x1b\x7f")) + text)], INVALID
    fingerprint = draw(st.text(min_size=1, max_size=20_000).filter(lambda f: f.strip() != ""))
    return [open_msg(tokenizer_fingerprint=fingerprint)], PRECONDITION


DEFECTS = st.one_of(bad_prompt(), bad_params(), bad_draft(), bad_root(), bad_order(), bad_strings())


class HonestClients:
    """Clients generating the whole time the fuzzing goes on, each checking its output against its solo one."""

    def __init__(self, verifier, n: int = 2) -> None:
        self.verifier = verifier
        self.prompts = [[(11 * i + j) % V for j in range(10 + i)] for i in range(n)]
        self.want = [solo_output(verifier, p, SamplingParams(max_new_tokens=24)) for p in self.prompts]
        self.stop, self.wrong = threading.Event(), []
        self.runs_of = [0] * n  # per client thread
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(n)]

    def _run(self, i: int) -> None:
        while not self.stop.is_set():
            got = solo_output(self.verifier, self.prompts[i], SamplingParams(max_new_tokens=24))
            self.runs_of[i] += 1
            if got != self.want[i]:
                self.wrong.append((i, got))

    @property
    def runs(self) -> int:
        return sum(self.runs_of)

    def __enter__(self) -> HonestClients:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()


def test_structured_defects_get_their_status_and_harm_no_one(verifier, session_call):
    seen: dict[str, int] = {}

    @settings(max_examples=STRUCTURED_EXAMPLES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                     HealthCheck.data_too_large])
    @given(DEFECTS)
    def check(case):
        messages, want = case
        code, details = run_stream(session_call, [m.SerializeToString() for m in messages])
        assert code == want, (messages[-1], details)
        assert details and len(details) < 500
        seen[code.name] = seen.get(code.name, 0) + 1

    with HonestClients(verifier) as honest:
        check()
    print("fuzz structured:", seen, "honest generations:", honest.runs)
    assert honest.runs >= 2 and not honest.wrong
    assert sum(seen.values()) >= STRUCTURED_EXAMPLES
    assert verifier.used_blocks() == 0
    assert healthy(verifier)


def mutate(data: bytes, rng: random.Random) -> bytes:
    kind = rng.randrange(5)
    if not data or kind == 0:
        return data + bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
    i = rng.randrange(len(data))
    if kind == 1:
        return data[:i] + bytes([data[i] ^ (1 << rng.randrange(8))]) + data[i + 1:]
    if kind == 2:
        return data[:i]
    if kind == 3:
        return data[:i] + data[i : i + rng.randint(1, 8)] * rng.randint(2, 4) + data[i:]
    return data[:i] + bytes(rng.randrange(256) for _ in range(rng.randint(1, 8))) + data[i:]


def test_mutated_traffic_on_the_wire_never_crashes_the_verifier(verifier, session_call):
    valid = [open_msg(draft=chain(3)).SerializeToString(), draft_msg(chain(4, 7)).SerializeToString(),
             draft_msg(pb.DraftTree(tokens=[5, 6, 7], parents=[-1, -1, 0], accept_probs=[0.5, 0.4, 0.2])
                       ).SerializeToString(), CLOSE.SerializeToString()]
    counts = [Counter() for _ in range(MUTATING_THREADS)]  # one per thread: `+=` on a shared one can lose counts
    bad: list = []

    def attack(seed: int) -> None:
        rng, codes = random.Random(seed), counts[seed]
        for _ in range(MUTATED_STREAMS // MUTATING_THREADS):
            messages = valid[: rng.randint(1, len(valid))]
            k = rng.randrange(len(messages))
            messages = messages[:k] + [mutate(messages[k], rng)] + messages[k + 1:]
            code, details = run_stream(session_call, messages)
            codes[code.name] += 1
            if not (code == grpc.StatusCode.OK or code in CLIENT_ERRORS) or len(details) >= 500:
                bad.append((code, details, messages))

    with HonestClients(verifier) as honest:
        attackers = [threading.Thread(target=attack, args=(seed,)) for seed in range(MUTATING_THREADS)]
        for t in attackers:
            t.start()
        for t in attackers:
            t.join()
    assert not bad, bad[:3]
    codes = sum(counts, Counter())
    print("fuzz mutated:", dict(codes), "honest generations:", honest.runs)
    assert sum(codes.values()) == MUTATED_STREAMS // MUTATING_THREADS * MUTATING_THREADS
    assert codes["INVALID_ARGUMENT"] > MUTATED_STREAMS // 10, codes  # the mutations did reach the validators
    assert honest.runs >= 2 and not honest.wrong
    assert verifier.used_blocks() == 0
    assert healthy(verifier)
