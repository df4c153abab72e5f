"""TLS on every hop of a cluster, over real gRPC on 127.0.0.1 with certificates made by openssl: edge ->
router, router -> verifiers, and verifiers registering with the router, each plain or mutual TLS. Relayed
sessions give the verifier's own output; a client without the right credentials is refused at the
handshake; under mutual TLS the verifier counts limits against the edge's certificate, passed on by a
router it trusts by the router's certificate; half-given or missing TLS files are refused by name."""

from __future__ import annotations

import grpc
import pytest
from test_cli import run_in_process
from test_grpc import GREEDY, PROMPT, tiny_verifier
from test_router import router_for, wait_for

from specedge.cloud.config import ServerConfig
from specedge.cloud.router.config import RouterConfig
from specedge.cloud.router.server import EmbeddedRouter, check_config
from specedge.cloud.server import check_tls
from specedge.common.draft_tree import DraftTree
from specedge.edge.generation import generate
from specedge.edge.transport import ChannelConfig, RemoteVerifier


def files(certs, name: str) -> dict[str, str]:
    return {"cert": str(certs / f"{name}.pem"), "key": str(certs / f"{name}.key")}


def serving(certs, name: str, mutual: bool) -> dict[str, str | None]:
    """Settings that serve TLS with `name`'s certificate, asking callers for theirs where `mutual`."""
    own = files(certs, name)
    return {"tls_cert": own["cert"], "tls_key": own["key"], "tls_client_ca": str(certs / "ca.pem") if mutual else None}


def to_verifiers(certs) -> dict[str, str]:
    """A router's settings that reach verifiers over TLS, presenting the router's certificate."""
    own = files(certs, "router")
    return {"verifier_tls_ca": str(certs / "ca.pem"), "verifier_tls_cert": own["cert"],
            "verifier_tls_key": own["key"]}


def edge(certs, name: str | None = "client", **extra) -> ChannelConfig:
    own = files(certs, name) if name else {"cert": None, "key": None}
    return ChannelConfig(tls_ca=str(certs / "ca.pem"), tls_cert=own["cert"], tls_key=own["key"], **extra)


def test_a_session_crosses_a_router_over_mutual_tls_on_both_hops_with_the_verifiers_own_output(certs):
    with tiny_verifier(**serving(certs, "server", mutual=True)) as v, \
            router_for(v, **serving(certs, "router", mutual=True), **to_verifiers(certs)) as router:
        direct = generate(RemoteVerifier(v.target, edge(certs)).open(PROMPT, GREEDY)).token_ids
        relayed = generate(RemoteVerifier(router.target, edge(certs)).open(PROMPT, GREEDY)).token_ids
        assert relayed == direct and len(relayed) == GREEDY.max_new_tokens
        for refused in (ChannelConfig(rpc_timeout_s=5), edge(certs, name=None)):  # plaintext; TLS, no certificate
            with pytest.raises(grpc.RpcError) as err:
                RemoteVerifier(router.target, refused)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_verifier_registers_over_tls_presenting_its_certificate_and_serves_through_the_router(certs):
    with EmbeddedRouter(RouterConfig(port=0, **serving(certs, "router", mutual=True), **to_verifiers(certs))) \
            as router, tiny_verifier(register=router.target, register_tls_ca=str(certs / "ca.pem"),
                                     **serving(certs, "server", mutual=True)) as v:
        wait_for(lambda: [m.address for m in router.call(router.fleet.pool)] == [v.target], "v to register")
        relayed = generate(RemoteVerifier(router.target, edge(certs)).open(PROMPT, GREEDY)).token_ids
        assert relayed == generate(RemoteVerifier(v.target, edge(certs)).open(PROMPT, GREEDY)).token_ids


def test_under_mutual_tls_a_verifier_counts_the_edges_certificate_relayed_by_a_router_it_trusts(certs):
    with tiny_verifier(max_sessions_per_client=1, trusted_relays="cert:router",
                       **serving(certs, "server", mutual=True)) as v, \
            router_for(v, **serving(certs, "router", mutual=True), **to_verifiers(certs)) as router:
        through = RemoteVerifier(router.target, edge(certs))
        held = through.open(PROMPT, GREEDY, client_id="one")
        held.step(DraftTree.empty())
        with pytest.raises(grpc.RpcError) as err:
            through.open(PROMPT, GREEDY, client_id="another").step(DraftTree.empty())
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "'cert:client' already has 1 open sessions" in err.value.details()
        held.close()
        wait_for(lambda: v.used_blocks() == 0, "the held session's blocks to be freed")


def test_the_operators_commands_reach_a_tls_router(certs, capsys):
    with tiny_verifier(**serving(certs, "server", mutual=False)) as v, \
            router_for(v, **serving(certs, "router", mutual=True), verifier_tls_ca=str(certs / "ca.pem")) as router:
        client = files(certs, "client")
        tls = ["--tls-ca", str(certs / "ca.pem"), "--tls-cert", client["cert"], "--tls-key", client["key"]]
        code, out, _ = run_in_process(capsys, "router", "list", "--router", router.target, *tls)
        assert code == 0 and out.startswith(f"{v.target}\thealthy"), out
        code, out, _ = run_in_process(capsys, "health", router.target, *tls)
        assert code == 0 and out.strip().endswith("SERVING"), out
        code, out, _ = run_in_process(capsys, "health", v.target, "--tls-ca", str(certs / "ca.pem"),
                                      "--tls-server-name", "localhost")
        assert code == 0, out
        code, out, _ = run_in_process(capsys, "health", router.target, "--timeout-s", "10")  # plaintext
        assert code == 1 and "UNAVAILABLE" in out, out


@pytest.mark.parametrize("settings, message", [
    ({"tls_cert": "CERT"}, "--tls-cert/--tls-key: a certificate and its key go together"),
    ({"tls_client_ca": "CA"}, "--tls-client-ca: mutual TLS needs TLS"),
    ({"tls_cert": "CERT", "tls_key": "nowhere.key"}, "--tls-cert/--tls-key: no such file: nowhere.key"),
    ({"verifier_tls_cert": "CERT", "verifier_tls_key": "KEY"}, "give the server's CA too"),
], ids=["half-a-pair", "mutual-without-tls", "missing-file", "client-certificate-without-ca"])
def test_a_router_refuses_tls_settings_that_cannot_work_by_name(certs, settings, message):
    named = {k: v.replace("CERT", str(certs / "router.pem")).replace("KEY", str(certs / "router.key"))
             .replace("CA", str(certs / "ca.pem")) for k, v in settings.items()}
    with pytest.raises(ValueError, match=message):
        check_config(RouterConfig(**named))
    with pytest.raises(ValueError, match=message):
        EmbeddedRouter(RouterConfig(port=0, **named))


def test_a_verifier_refuses_tls_settings_that_cannot_work_by_name_before_loading_its_model(certs, capsys):
    with pytest.raises(ValueError, match="a certificate and its key go together"):
        check_tls(ServerConfig(tls_key=str(certs / "server.key")))
    with pytest.raises(ValueError, match="--register-tls-ca is for the router of --register"):
        check_tls(ServerConfig(register_tls_ca=str(certs / "ca.pem")))
    with pytest.raises(ValueError, match="--tls-client-ca: mutual TLS needs TLS"):
        check_tls(ServerConfig(tls_client_ca=str(certs / "ca.pem")))
    code, _, err = run_in_process(capsys, "serve", "--model", "no-such-model", "--tls-cert", str(certs / "server.pem"))
    assert code != 0 and "specedge serve: --tls-cert/--tls-key: a certificate and its key go together" in err


def test_ray_up_gives_every_replica_its_tls_and_trust_settings_and_refuses_a_half_pair(certs, capsys):
    from specedge.cli import build_parser
    from specedge.cli.ray import replica_config

    own, ca = files(certs, "server"), str(certs / "ca.pem")
    args = build_parser().parse_args(["ray", "up", "--router", "router:50050", "--tls-cert", own["cert"],
                                      "--tls-key", own["key"], "--tls-client-ca", ca, "--register-tls-ca", ca,
                                      "--trusted-relays", "cert:router", "--auth-token", "s3cret"])
    config = replica_config(args)
    assert (config.tls_cert, config.tls_key, config.tls_client_ca, config.register_tls_ca) == (
        own["cert"], own["key"], ca, ca)
    assert (config.register, config.trusted_relays, config.auth_token) == ("router:50050", "cert:router", "s3cret")
    code, _, err = run_in_process(capsys, "ray", "up", "--router", "router:50050", "--tls-cert", own["cert"])
    assert code != 0 and "specedge ray up: --tls-cert/--tls-key: a certificate and its key go together" in err


@pytest.mark.real_model
def test_bench_and_index_build_use_a_remote_verifier_over_tls_with_its_token(certs, tmp_path, real_model):
    """`specedge bench --server` and `specedge index build --server` (the edge's commands that take a
    verifier's address) against one that wants TLS and a bearer token, as a cloud one would."""
    import json

    from specedge.cli import main
    from specedge.cloud.launch import EmbeddedVerifier

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "1", "category": "qa", "prompt": "Name three colours."}))
    config = ServerConfig(model="smollm2-135m", port=0, auth_token="s3cret", **serving(certs, "server", mutual=False))
    flags = ["bench", "--prompts", str(prompts), "--max-new-tokens", "8", "--reps", "1", "--baselines", "server-ar"]
    with EmbeddedVerifier(config, real_model("smollm2-135m")) as verifier:
        out = tmp_path / "out"
        assert main([*flags, "--server", verifier.target, "--tls-ca", str(certs / "ca.pem"), "--auth-token",
                     "s3cret", "--out", str(out)]) == 0
        rows = json.loads((out / "results.json").read_text())["rows"]
        assert {r["method"] for r in rows} == {"server-ar", "retrieval"} and all(r["tokens_per_s"] > 0 for r in rows)
        with pytest.raises(SystemExit, match="UNAVAILABLE"):  # plaintext against TLS
            main([*flags, "--server", verifier.target, "--auth-token", "s3cret", "--out", str(tmp_path / "no")])
        (tmp_path / "notes.txt").write_text("Red, green and blue are colours. " * 20)
        store = tmp_path / "store"
        assert main(["index", "build", str(tmp_path / "notes.txt"), "-o", str(store), "--server", verifier.target,
                     "--tls-ca", str(certs / "ca.pem"), "--auth-token", "s3cret"]) == 0
        assert any(store.iterdir())
        with pytest.raises(SystemExit, match="specedge index build: cannot use --server .*: UNAUTHENTICATED"):
            main(["index", "build", str(tmp_path / "notes.txt"), "-o", str(tmp_path / "no-store"), "--server",
                  verifier.target, "--tls-ca", str(certs / "ca.pem")])
