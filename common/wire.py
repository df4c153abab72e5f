"""Conversions between the project's value types and the wire messages of protos/specedge/v1, with the
validation a verifier applies to everything a client sends (errors are ValueError with a message)."""

from __future__ import annotations

from specedge.common.cost_model import CostModel
from specedge.common.draft_tree import DraftTree
from specedge.common.hints import Hints
from specedge.common.params import SamplingParams
from specedge.common.tokenizer_bundle import TokenizerBundle
from specedge.protos import verifier_pb2 as pb

# Trailing metadata of a RESOURCE_EXHAUSTED that is "not now" rather than "never": milliseconds after which
# the same request may succeed (the KV pool was full of other sessions). The SDK resumes then.
RETRY_AFTER_MS = "specedge-retry-after-ms"
# Trailing metadata of an UNAVAILABLE from a draining verifier: reopen the session elsewhere now, with the
# prompt plus the committed tokens (no back-off: the stream ended at a round boundary on purpose).
MIGRATE = "specedge-migrate"
MAX_CLIENT_ID = 128  # characters of the label a client gives itself (logged with its sessions)
TOKENIZER_PART_BYTES = 1 << 20  # gRPC's default message limit is 4 MiB; Gemma 3's tokenizer.json is 33 MB


def tree_to_pb(tree: DraftTree, root_length: int | None = None, fill_tokens: int = 0) -> pb.DraftTree:
    """`root_length`: for a tree sent ahead of verdicts, the sequence length at its root (0/absent: the end);
    `fill_tokens`: for a tree ahead, how many nodes in all it may have once the verifier has added its own
    draft to what is left of it (0: none added)."""
    msg = pb.DraftTree(tokens=tree.tokens, parents=tree.parents, accept_probs=tree.accept_probs or [],
                       root_length=root_length or 0, fill_tokens=fill_tokens)
    for parent, (ids, probs) in (tree.proposals or {}).items():
        msg.proposals.add(parent=parent, token_ids=ids, probs=probs)
    return msg


def tree_from_pb(msg: pb.DraftTree, vocab_size: int, max_nodes: int) -> DraftTree:
    if len(msg.tokens) > max_nodes:
        raise ValueError(f"draft tree has {len(msg.tokens)} nodes; this verifier takes at most {max_nodes}")
    proposals = None
    if msg.proposals:
        proposals = {}
        for p in msg.proposals:
            if p.parent in proposals:
                raise ValueError(f"two proposals for node {p.parent}")
            proposals[p.parent] = (list(p.token_ids), list(p.probs))
    tree = DraftTree(list(msg.tokens), list(msg.parents), proposals,
                     list(msg.accept_probs) if msg.accept_probs else None)
    tree.validate(vocab_size)
    return tree


def hints_to_pb(hints: Hints) -> pb.Hints:
    k = max((len(row) for row in hints.ids), default=0)
    if any(len(row) != k for row in hints.ids):
        raise ValueError("every row of hints must hold the same number of tokens")
    probs = bytes(min(255, max(0, round(p * 255))) for row in hints.probs for p in row)
    return pb.Hints(k=k, token_ids=[t for row in hints.ids for t in row], probs=probs)


def hints_from_pb(msg: pb.Hints) -> Hints | None:
    """None for a verdict without hints."""
    k = msg.k
    if k <= 0:
        return None
    if len(msg.token_ids) % k or len(msg.probs) != len(msg.token_ids):
        raise ValueError(f"malformed hints: {len(msg.token_ids)} token ids and {len(msg.probs)} probabilities "
                         f"in rows of {k}")
    ids, probs = list(msg.token_ids), [b / 255 for b in msg.probs]
    return Hints([ids[i : i + k] for i in range(0, len(ids), k)], [probs[i : i + k] for i in range(0, len(ids), k)])


def params_to_pb(params: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                            max_new_tokens=params.max_new_tokens)
    if params.seed is not None:
        msg.seed = params.seed
    return msg


DEFAULT_MAX_NEW_TOKENS = 128  # where a request leaves max_new_tokens at 0


def params_from_pb(msg: pb.SamplingParams, max_new_tokens_limit: int) -> SamplingParams:
    max_new = msg.max_new_tokens or DEFAULT_MAX_NEW_TOKENS
    if max_new > max_new_tokens_limit:
        raise ValueError(f"max_new_tokens {max_new} is over this verifier's limit of {max_new_tokens_limit}")
    return SamplingParams(temperature=msg.temperature, top_p=msg.top_p or 1.0, top_k=msg.top_k,
                          seed=msg.seed if msg.HasField("seed") else None, max_new_tokens=max_new)


def client_label(client_id: str) -> str | None:
    """The `client_id` a client sends, checked before it is logged: None when it sent none."""
    if len(client_id) > MAX_CLIENT_ID:
        raise ValueError(f"client_id has {len(client_id)} characters; at most {MAX_CLIENT_ID} are taken")
    if not client_id.isprintable():
        raise ValueError("client_id must be printable text, without control characters")
    return client_id or None


def shown(text: str, limit: int = 64) -> str:
    """A string a client sent, as an error message or a log line may quote it: its repr cut to `limit`
    characters (a long one would fill the log, or overflow gRPC's limit on the status message's metadata)."""
    quoted = repr(text)
    return quoted if len(quoted) <= limit + 2 else f"{quoted[:limit]}... ({len(text)} characters)"


def prompt_from_pb(ids, vocab_size: int, max_tokens: int) -> list[int]:
    ids = list(ids)
    if not ids:
        raise ValueError("the prompt is empty")
    if len(ids) > max_tokens:
        raise ValueError(f"the prompt has {len(ids)} tokens; this verifier takes at most {max_tokens}")
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab_size})")
    return ids


def cost_to_pb(cost: CostModel, active_sessions: int = 0) -> pb.CostModel:
    return pb.CostModel(tree_tokens=[n for n, _ in cost.points], ms=[t for _, t in cost.points],
                        active_sessions=active_sessions)


def cost_from_pb(msg: pb.CostModel) -> CostModel:
    return CostModel(tuple(zip(msg.tree_tokens, msg.ms)))


def tokenizer_to_parts(bundle: TokenizerBundle, fingerprint: str) -> list[pb.TokenizerPart]:
    data = bundle.tokenizer_json
    config = pb.TokenizerConfig(fingerprint=fingerprint, chat_template=bundle.chat_template,
                                special_tokens=bundle.special_tokens, clean_up_spaces=bundle.clean_up_spaces,
                                tokenizer_json_bytes=len(data))
    parts = [pb.TokenizerPart(tokenizer_json=data[i : i + TOKENIZER_PART_BYTES])
             for i in range(0, len(data), TOKENIZER_PART_BYTES)] or [pb.TokenizerPart()]
    parts[0].config.CopyFrom(config)
    return parts


def tokenizer_from_parts(parts) -> TokenizerBundle:
    config, data = None, bytearray()
    for part in parts:
        if config is None:
            config = part.config
        data += part.tokenizer_json
    if config is None or len(data) != config.tokenizer_json_bytes:
        raise ValueError(f"incomplete tokenizer: {len(data)} of {config and config.tokenizer_json_bytes} bytes")
    return TokenizerBundle(bytes(data), config.chat_template if config.HasField("chat_template") else None,
                           dict(config.special_tokens), config.clean_up_spaces)
