"""deploy/: every Kubernetes manifest validates against the Kubernetes schemas (offline, with
kubernetes-validate), every command line in a manifest, the Dockerfile and the systemd unit is
parsed by the real parser it targets (kvtier's argparse, vLLM's `vllm serve` parser), so a
renamed flag breaks this test, and every server config loads with ``ServeConfig``."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from kvtier.cli import build_parser
from kvtier.config import build
from kvtier.server.server import ServeConfig
from kvtier.tiers.registry import TIERS

ROOT = Path(__file__).resolve().parents[1]
KUBE = ROOT / "deploy" / "kubernetes"
KUSTOMIZATIONS = sorted(p.parent for p in KUBE.rglob("kustomization.yaml"))
K8S_VERSION = "1.30.0"
UID = 10001  # the user the cache server runs as; engines must be the same user


# -- reading manifests -----------------------------------------------------------------------
def _docs(text: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(text) if d]


def _kustomization(folder: Path) -> dict:
    return yaml.safe_load((folder / "kustomization.yaml").read_text())


def _resource_files() -> list[Path]:
    """Files listed as ``resources`` (whole objects; patches are checked in the built output)."""
    files = []
    for folder in KUSTOMIZATIONS:
        for entry in _kustomization(folder).get("resources", []):
            path = (folder / entry).resolve()
            if path.is_file():
                files.append(path)
    return sorted(set(files))


def _kustomize(folder: Path) -> list[dict]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl (for `kubectl kustomize`) not installed")
    out = subprocess.run([kubectl, "kustomize", str(folder)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return _docs(out.stdout)


def _pod_specs(doc: dict) -> Iterator[dict]:
    spec = doc.get("spec", {})
    if doc["kind"] in ("Deployment", "DaemonSet", "StatefulSet", "Job"):
        yield spec["template"]["spec"]


def _containers(doc: dict) -> Iterator[dict]:
    for pod in _pod_specs(doc):
        yield from pod.get("initContainers", [])
        yield from pod.get("containers", [])


def _all_docs() -> list[dict]:
    """Every object: the resource files, plus each kustomization's build when kubectl exists."""
    docs = [d for f in _resource_files() for d in _docs(f.read_text())]
    if shutil.which("kubectl"):
        for folder in KUSTOMIZATIONS:
            docs += _kustomize(folder)
    return docs


# -- parsers ---------------------------------------------------------------------------------
def _parse_kvtier(argv: list[str]):
    """kvtier's own parser; a flag it does not know fails the test (argparse exits 2)."""
    try:
        return build_parser().parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"kvtier {shlex.join(argv)}: rejected by kvtier's parser (exit {exc.code})")


@pytest.fixture(scope="module")
def vllm_serve_parser():
    """vLLM's own `vllm serve` parser (make_arg_parser on a FlexibleArgumentParser)."""
    pytest.importorskip("vllm")
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm")
    ServeSubcommand().subparser_init(parser.add_subparsers(dest="subparser"))
    return parser


def _parse_vllm_serve(parser, argv: list[str]):
    """Parse ``vllm serve ARGV``; then check what kvtier reads from it with kvtier's own configs."""
    from kvtier.integrations.vllm.config import ConnectorConfig
    from kvtier.integrations.vllm.loader import KVTierLoadOptions

    try:
        args = parser.parse_args(["serve", *argv])
    except SystemExit as exc:
        pytest.fail(f"vllm serve {shlex.join(argv)}: rejected by vLLM's parser (exit {exc.code})")
    if args.kv_transfer_config is not None:
        ConnectorConfig.from_extra_config(args.kv_transfer_config.kv_connector_extra_config)
    if args.load_format == "kvtier":
        build(KVTierLoadOptions, args.model_loader_extra_config or {}, "model_loader_extra_config")
    return args


def _check_serve_config(mapping: dict) -> ServeConfig:
    """ServeConfig and, for each tier, the tier's own config class (keys and value types)."""
    config = ServeConfig.from_mapping(mapping)
    for i, spec in enumerate(config.store.tiers):
        spec = dict(spec)
        cls = TIERS.get(spec.pop("type"))
        spec.pop("name", None)
        build(cls.Config, spec, f"serve.store.tiers[{i}]")
    return config


# -- Kubernetes ------------------------------------------------------------------------------
def test_layout_and_every_resource_file_validates():
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    assert {p.relative_to(KUBE).as_posix() for p in KUSTOMIZATIONS} == {
        "base", "overlays/valkey", "overlays/s3", "overlays/rwx-cache"}
    files = _resource_files()
    assert len(files) >= 8
    for path in files:
        for doc in _docs(path.read_text()):
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


@pytest.mark.parametrize("folder", KUSTOMIZATIONS, ids=lambda p: p.relative_to(KUBE).as_posix())
def test_kustomize_build_validates(folder):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    docs = _kustomize(folder)
    kinds = {d["kind"] for d in docs}
    assert {"Namespace", "ConfigMap", "DaemonSet", "Deployment", "Service"} <= kinds
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        assert doc["kind"] == "Namespace" or doc["metadata"]["namespace"] == "kvtier"


def test_cache_server_daemonset_shape():
    (ds,) = [d for d in _docs((KUBE / "base" / "cache-server.yaml").read_text())]
    pod = ds["spec"]["template"]
    assert pod["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    (serve,) = pod["spec"]["containers"]
    port = pod["metadata"]["annotations"]["prometheus.io/port"]
    assert serve["readinessProbe"]["httpGet"]["path"] == "/healthz"
    assert {p["name"]: str(p["containerPort"]) for p in serve["ports"]}["metrics"] == port
    assert serve["resources"]["limits"]["memory"] and serve["securityContext"]["runAsUser"] == UID
    host = {v["name"]: v["hostPath"]["path"] for v in pod["spec"]["volumes"] if "hostPath" in v}
    assert host["socket-dir"] == "/run/kvtier" and host["shm-dir"] == "/dev/shm/kvtier"


def test_every_config_map_loads_with_serve_config():
    """The base ConfigMap and each overlay's replacement; the paths agree with the pods'."""
    maps = [d for f in KUBE.rglob("*.yaml") for d in _docs(f.read_text())
            if isinstance(d, dict) and d.get("kind") == "ConfigMap" and d["metadata"]["name"] == "kvtier-serve"]
    assert len(maps) == 3
    types = set()
    for cm in maps:
        config = _check_serve_config(yaml.safe_load(cm["data"]["serve.yaml"]))
        assert config.listen == "unix:///run/kvtier/kvtier.sock" and config.shm_dir == "/dev/shm/kvtier"
        assert config.metrics.endswith(":9400")
        types |= {t["type"] for t in config.store.tiers}
    assert types == {"ram", "disk", "redis", "s3"}


def test_every_command_line_parses(vllm_serve_parser):
    """kvtier containers (image kvtier, no command: the image's entrypoint is `kvtier`) through
    kvtier's parser, `vllm serve` containers through vLLM's; a pod's model path is where its
    `kvtier pull` puts the model."""
    from kvtier.loader.cache import cache_path

    seen = {"kvtier": 0, "vllm": 0, "route": 0}
    for doc in _all_docs():
        pulled = []
        for c in _containers(doc):
            image = c["image"].rsplit("/", 1)[-1].split(":")[0]
            kvtier_argv = (c["args"] if image == "kvtier" and "command" not in c
                           else c["command"][1:] + c.get("args", []) if c.get("command", [""])[0] == "kvtier"
                           else None)
            if kvtier_argv is not None:
                args = _parse_kvtier(kvtier_argv)
                seen["kvtier"] += 1
                if args.command == "pull":
                    pulled.append(cache_path(args.cache_dir, args.uri))
                if args.command == "serve":
                    assert args.config == "/etc/kvtier/serve.yaml"
                if args.command == "route":
                    seen["route"] += 1
            elif c.get("command", [])[:2] == ["vllm", "serve"]:
                args = _parse_vllm_serve(vllm_serve_parser, c["command"][2:] + c.get("args", []))
                seen["vllm"] += 1
                assert args.load_format == "kvtier"
                assert args.kv_transfer_config.kv_connector == "KVTierConnector"
                assert args.kv_transfer_config.kv_connector_module_path is None  # the plugin registers it
                assert args.kv_transfer_config.kv_load_failure_policy == "recompute"
                assert args.kv_transfer_config.kv_connector_extra_config["server"] == "unix:///run/kvtier/kvtier.sock"
                assert args.model_tag in pulled, (args.model_tag, pulled)
            else:
                assert c.get("command", [""])[0] in ("sh", "sleep") or image == "valkey", c
    assert seen["kvtier"] >= 4 and seen["vllm"] >= 1 and seen["route"] >= 1


def test_engines_run_as_the_servers_user():
    vllm = _docs((KUBE / "base" / "vllm.yaml").read_text())[0]
    assert vllm["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == UID


def _flag_values(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]


def test_router_lists_every_engine_and_its_event_endpoints():
    """`kvtier route` takes a static engine list: it names each StatefulSet pod through the
    headless Service, with the ports vLLM's --kv-events-config binds; its Service, probe and
    scrape annotations use its --port."""
    vllm, _svc, headless = _docs((KUBE / "base" / "vllm.yaml").read_text())
    router, service = _docs((KUBE / "base" / "router.yaml").read_text())
    assert vllm["kind"] == "StatefulSet" and headless["spec"]["clusterIP"] == "None"
    assert vllm["spec"]["serviceName"] == headless["metadata"]["name"]
    (engine,) = vllm["spec"]["template"]["spec"]["containers"]
    events = json.loads(_flag_values(engine["args"], "--kv-events-config")[0])
    assert events["enable_kv_cache_events"] and events["publisher"] == "zmq"
    pub_port, replay_port = (int(events[k].rsplit(":", 1)[1]) for k in ("endpoint", "replay_endpoint"))
    engine_port = int(_flag_values(engine["args"], "--port")[0])
    assert {p["containerPort"] for p in engine["ports"]} == {engine_port, pub_port, replay_port}
    assert {p["port"] for p in headless["spec"]["ports"]} == {engine_port, pub_port, replay_port}

    (c,) = router["spec"]["template"]["spec"]["containers"]
    argv = c["command"][1:] + c["args"]
    args = _parse_kvtier(argv)
    assert args.command == "route"
    hosts = [f"{vllm['metadata']['name']}-{i}.{headless['metadata']['name']}" for i in range(vllm["spec"]["replicas"])]
    assert args.engine == [f"http://{h}:{engine_port}" for h in hosts]
    assert args.kv_events == [f"tcp://{h}:{pub_port}" for h in hosts]
    assert args.kv_replay == [f"tcp://{h}:{replay_port}" for h in hosts]
    assert args.tokenizer and args.host == "0.0.0.0"
    pod = router["spec"]["template"]
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(args.port) == "9000"
    assert pod["metadata"]["annotations"]["prometheus.io/path"] == "/metrics"
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    assert {p["name"]: p["containerPort"] for p in c["ports"]}["http"] == args.port
    assert service["spec"]["ports"][0]["port"] == args.port
    assert pod["spec"]["securityContext"]["runAsUser"] == UID


# -- Dockerfile ------------------------------------------------------------------------------
def _dockerfile_stages() -> dict[str, dict[str, Any]]:
    """Per stage: its JSON-form ENTRYPOINT and CMD, and the extras it installs."""
    stages: dict[str, dict[str, Any]] = {}
    current: dict[str, Any] = {}
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    for line in text.splitlines():
        word, _, rest = line.strip().partition(" ")
        if word == "FROM":
            current = stages.setdefault(rest.split(" AS ")[-1].strip(), {"extras": []})
        elif word in ("ENTRYPOINT", "CMD"):
            current[word] = json.loads(rest)
        elif word == "RUN":
            current["extras"] += re.findall(r"kvtier-\*\.whl\)\[([\w,]+)\]", rest)
        elif word == "USER":
            current["user"] = rest.strip()
    return stages


def test_dockerfile_commands_and_extras(vllm_serve_parser):
    stages = _dockerfile_stages()
    kvtier, engine = stages["kvtier"], stages["kvtier-vllm"]
    assert kvtier["ENTRYPOINT"] == ["kvtier"]
    _parse_kvtier(kvtier["CMD"])
    assert kvtier["user"] == f"{UID}:{UID}"
    assert engine["ENTRYPOINT"] == ["vllm", "serve"]
    pyproject = (ROOT / "pyproject.toml").read_text()
    for extras in kvtier["extras"] + engine["extras"]:
        for extra in extras.split(","):
            assert re.search(rf"^{extra} = \[", pyproject, re.M), extra
    # the engine image's extras must never bring a vLLM of their own
    section = pyproject.split("[project.optional-dependencies]")[1].split("\n[")[0]
    assert not re.search(r'"vllm(-cpu)?[<>=; ]', section)


# -- systemd ---------------------------------------------------------------------------------
def test_systemd_unit_command_and_config():
    unit = (ROOT / "deploy" / "systemd" / "kvtier-serve.service").read_text()
    fields = dict(line.split("=", 1) for line in unit.splitlines() if "=" in line and not line.startswith("#"))
    argv = shlex.split(fields["ExecStart"])
    assert argv[0].endswith("/kvtier")
    args = _parse_kvtier(argv[1:])
    assert args.command == "serve" and args.config == "/etc/kvtier/serve.yaml"
    config = _check_serve_config(yaml.safe_load((ROOT / "deploy" / "systemd" / "serve.yaml").read_text()))
    assert config.listen == f"unix:///run/{fields['RuntimeDirectory']}/kvtier.sock"
    assert fields["RuntimeDirectoryMode"] == "0700"  # the server refuses a socket directory others can write


# -- README ----------------------------------------------------------------------------------
def _readme_commands(program: str) -> list[list[str]]:
    """Each README command starting with ``program`` (fenced or indented), continuation lines
    joined; commands with a shell substitution are kept with it replaced by a placeholder."""
    lines = (ROOT / "README.md").read_text().splitlines()
    fenced = [False] * len(lines)
    inside = False
    for n, line in enumerate(lines):
        if line.startswith("```"):
            inside = not inside
        fenced[n] = inside
    out = []
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        code = fenced[i] or lines[i].startswith("    ")
        if code and line.startswith(program + " "):
            cmd = lines[i]
            while cmd.rstrip().endswith("\\") or cmd.count("'") % 2:
                i += 1
                cmd = cmd.rstrip().removesuffix("\\") + "\n" + lines[i]
            cmd = re.sub(r'"\$\([^)]*\)"', "/models/pulled", cmd.split("  #")[0])
            out.append(shlex.split(cmd, comments=True)[len(program.split()):])
        i += 1
    return out


def test_readme_vllm_serve_commands_parse(vllm_serve_parser):
    commands = _readme_commands("vllm serve")
    assert len(commands) >= 5
    for argv in commands:
        _parse_vllm_serve(vllm_serve_parser, argv)


def test_readme_kvtier_commands_parse():
    commands = [c for c in _readme_commands("kvtier") if c and not c[0].startswith("[")]
    assert len(commands) >= 6
    for argv in commands:
        argv = [a for a in argv if not (a.startswith("[") or a.endswith("]") or a == "|" or "..." in a)]
        _parse_kvtier(argv)
