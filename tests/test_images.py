"""The images start (issue 23): for each image target of the Dockerfile, exactly that target's
``pip install`` line (the wheel built from this tree, the same extras) goes into a fresh venv
outside the tree, and the commands deploy/'s manifests run with that image run from it, with
their arguments read from the manifests:

* image ``kvtier``: ``kvtier serve`` with each ConfigMap's ``serve.yaml`` (base, and the valkey and
  s3 overlays against redis-server and SeaweedFS), answering ``/healthz`` and ``/metrics``; every
  ``kvtier pull`` (preloader, engines' and router's init containers, the rwx-cache Job) from
  SeaweedFS into the node cache the pods mount.
* image ``kvtier-vllm`` (layered on a vLLM image, whose vLLM is not installed here): its extras
  resolve and install, the modules of ``kvtier.integrations.vllm`` that vLLM's plugin loader and
  the engine's config read first import without vLLM, ``kvtier route --help`` runs, and the
  router's container command starts against two stub engines and relays a completion. ``vllm
  serve`` itself is left to tests/test_deploy.py (vLLM's own parser) and the vLLM tests.

What is rewritten, and only that: absolute paths move under a temporary root (the pod's mounts),
cluster addresses (engines, Valkey, S3 endpoint from the Secret) become the local servers,
listen addresses become loopback with free ports, and the RAM arena and staging are shrunk
(``posix_fallocate`` really reserves them; 8 GiB is not this machine's to take). A manifest, an
extra or an import that drifts fails here. The installs use PyPI through pip's cache (marker
``install``: deselect with ``-m 'not install'``).
"""

from __future__ import annotations

import http.server
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
KUBE = ROOT / "deploy" / "kubernetes"

pytestmark = pytest.mark.install

SMALL = {"ram": "64MiB", "staging": "16MiB"}  # the sizes this machine can reserve


# -- the Dockerfile --------------------------------------------------------------------------
def _targets() -> dict[str, dict[str, Any]]:
    """Per stage that installs the wheel: its extras and its JSON-form ENTRYPOINT."""
    stages: dict[str, dict[str, Any]] = {}
    current: dict[str, Any] = {}
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    for line in text.splitlines():
        word, _, rest = line.strip().partition(" ")
        if word == "FROM":
            current = stages.setdefault(rest.split(" AS ")[-1].strip(), {"extras": [], "base": rest.split()[0]})
        elif word == "ENTRYPOINT":
            current["entrypoint"] = json.loads(rest)
        elif word == "RUN" and "pip install" in rest:
            current["extras"] += re.findall(r'pip install [^"]*"\$\(ls /wheels/kvtier-\*\.whl\)\[([\w,]+)\]"', rest)
    return {name: s for name, s in stages.items() if s["extras"]}


def test_dockerfile_targets_are_the_ones_tested():
    targets = _targets()
    assert set(targets) == {"kvtier", "kvtier-vllm"}, targets
    for name, stage in targets.items():
        assert len(stage["extras"]) == 1, (name, stage)  # one pip install line of the wheel per target


# -- manifests -------------------------------------------------------------------------------
def _docs() -> Iterator[tuple[Path, dict]]:
    for path in sorted(KUBE.rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if isinstance(doc, dict) and "kind" in doc:
                yield path, doc


def _containers() -> Iterator[tuple[Path, str, dict]]:
    """(file, image name, container) for every container and init container of every workload."""
    for path, doc in _docs():
        if doc["kind"] in ("Deployment", "DaemonSet", "StatefulSet", "Job") and "template" in doc.get("spec", {}):
            pod = doc["spec"]["template"]["spec"]
            for c in pod.get("initContainers", []) + pod.get("containers", []):
                yield path, c["image"].rsplit("/", 1)[-1].split(":")[0], c


def _argv(image: str, container: dict) -> list[str]:
    """The container's command line: its command, else the image's ENTRYPOINT; then its args."""
    head = container.get("command") or _targets()[image]["entrypoint"]
    return [*head, *container.get("args", [])]


def _kvtier_commands(subcommand: str) -> list[tuple[str, str, list[str]]]:
    """(file, image, argv after ``kvtier``) of every container running ``kvtier SUBCOMMAND``."""
    out = []
    for path, image, c in _containers():
        if image in _targets():
            argv = _argv(image, c)
            if argv[0] == "kvtier" and argv[1:2] == [subcommand]:
                out.append((path.relative_to(ROOT).as_posix(), image, argv[1:]))
    return out


def _local_path(value: str, root: Path) -> str:
    """An absolute path (or ``unix://`` address) moved under ``root``; anything else unchanged."""
    if value.startswith("unix:///"):
        return "unix://" + str(root) + value[len("unix://"):]
    if value.startswith("/"):
        return str(root) + value
    return value


def _run(cmd: list[str], timeout: float = 600, **kw) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    assert out.returncode == 0, f"{shlex.join(cmd)}: exit {out.returncode}\n{out.stderr[-3000:]}"
    return out


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV") and not k.startswith("AWS_")}
    env.update(extra)
    return env


# -- the fresh venvs -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel, built with ``pip wheel --no-deps`` from a copy of this tree's sources."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "kvtier", src / "kvtier", ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.so"))
    out = tmp_path_factory.mktemp("wheels")
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
          str(src)], cwd=src, env=_env(KVTIER_NO_EXTENSIONS="1"))  # as the Dockerfile builds it
    (whl,) = out.glob("kvtier-*.whl")
    assert whl.name.endswith("-py3-none-any.whl"), whl.name  # one wheel for any engine image's Python
    return whl


_VENVS: dict[str, Path] = {}


def _image_venv(target: str, wheel: Path, tmp_path_factory) -> Path:
    """A fresh venv (outside the tree) holding exactly ``target``'s ``pip install`` line."""
    if target not in _VENVS:
        (extras,) = _targets()[target]["extras"]
        home = tmp_path_factory.mktemp(f"venv-{target}")
        _run([sys.executable, "-m", "venv", "--without-pip", str(home / "v")], cwd=home)
        _run([sys.executable, "-m", "pip", "--python", str(home / "v" / "bin" / "python"), "install", "-q",
              "--disable-pip-version-check", f"{wheel}[{extras}]"], cwd=home, env=_env())
        _VENVS[target] = home / "v"
    return _VENVS[target]


@pytest.fixture(scope="module")
def kvtier_image(wheel, tmp_path_factory) -> Path:
    return _image_venv("kvtier", wheel, tmp_path_factory)


@pytest.fixture(scope="module")
def kvtier_vllm_image(wheel, tmp_path_factory) -> Path:
    return _image_venv("kvtier-vllm", wheel, tmp_path_factory)


def test_image_venvs_hold_the_installed_wheel_only(kvtier_image):
    """The venv imports kvtier from itself, not the tree, and has no torch, vLLM or aiohttp."""
    code = ("import importlib.util as u, json, kvtier; print(json.dumps({'file': kvtier.__file__, 'absent': "
            "[m for m in ('torch', 'vllm', 'aiohttp') if u.find_spec(m) is None]}))")
    out = json.loads(_run([str(kvtier_image / "bin" / "python"), "-c", code], cwd="/", env=_env()).stdout)
    assert out["file"].startswith(str(kvtier_image)) and out["absent"] == ["torch", "vllm", "aiohttp"]


# -- kvtier serve ----------------------------------------------------------------------------
def _serve_container() -> tuple[dict, dict, dict]:
    """The cache server DaemonSet's container, its pod spec and the pod template's annotations."""
    for _path, doc in _docs():
        if doc["kind"] == "DaemonSet" and doc["metadata"]["name"] == "kvtier-cache-server":
            template = doc["spec"]["template"]
            (serve,) = template["spec"]["containers"]
            return serve, template["spec"], template["metadata"].get("annotations", {})
    pytest.fail("no kvtier-cache-server DaemonSet")


def _config_maps() -> dict[str, dict]:
    """folder (base, overlays/NAME) -> the kvtier-serve ConfigMap defined there."""
    return {path.parent.relative_to(KUBE).as_posix(): doc for path, doc in _docs()
            if doc["kind"] == "ConfigMap" and doc["metadata"]["name"] == "kvtier-serve"}


def _node_dirs(pod: dict, root: Path) -> None:
    """Run the pod's ``node-dirs`` init container (``sh -c "install -d ..."``) with its paths
    under ``root`` and without ``-o``/``-g`` (the test runs as one user)."""
    (init,) = [c for c in pod.get("initContainers", []) if c["name"] == "node-dirs"]
    assert init["command"][:2] == ["sh", "-c"]
    for part in init["command"][2].split("&&"):
        words = shlex.split(part)
        words = [w for i, w in enumerate(words) if w not in ("-o", "-g") and words[i - 1] not in ("-o", "-g")]
        _run([_local_path(w, root) for w in words])


def _localize_config(config: Any, root: Path, services: dict[str, str]) -> Any:
    """Paths under ``root``, cluster services to local ones, metrics on a free loopback port,
    the RAM arena and staging shrunk to ``SMALL``."""
    if isinstance(config, dict):
        out = {k: _localize_config(v, root, services) for k, v in config.items()}
        if "metrics" in out:
            out["metrics"] = "127.0.0.1:0"
        if "staging" in out:
            out["staging"] = SMALL["staging"]
        if out.get("type") == "ram":
            out["capacity"] = SMALL["ram"]
        return out
    if isinstance(config, list):
        return [_localize_config(v, root, services) for v in config]
    if isinstance(config, str):
        for remote, local in services.items():
            config = config.replace(remote, local)
        return _local_path(config, root)
    return config


def _wait_line(proc: subprocess.Popen, prefix: str, timeout: float = 60) -> str:
    """Read ``proc``'s stderr until a line starting with ``prefix``; that line."""
    deadline = time.monotonic() + timeout
    seen: list[str] = []
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            if proc.poll() is not None:
                pytest.fail(f"exited {proc.returncode} before {prefix!r}:\n{''.join(seen)[-3000:]}")
            continue
        seen.append(line)
        if line.startswith(prefix):
            return line.strip()
    pytest.fail(f"no {prefix!r} in {timeout} s:\n{''.join(seen)[-3000:]}")


def _stop(proc: subprocess.Popen) -> tuple[int, str]:
    """SIGTERM (the kubelet's stop), then the exit code and the rest of stderr."""
    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    return proc.returncode, err


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.mark.parametrize("folder", ["base", pytest.param("overlays/valkey", marks=pytest.mark.redis),
                                    pytest.param("overlays/s3", marks=pytest.mark.s3)])
def test_serve_runs_each_config_map(folder, kvtier_image, tmp_path_factory, request):
    """The DaemonSet's container command with the ConfigMap mounted where the pod mounts it:
    ready line, /healthz 200 (its readiness and liveness probe), /metrics in Prometheus text,
    SIGTERM -> exit 0."""
    serve, pod, annotations = _serve_container()
    cm = _config_maps()[folder]
    root = tmp_path_factory.mktemp("pod")
    env = _env()
    services: dict[str, str] = {}
    config = yaml.safe_load(cm["data"]["serve.yaml"])
    types = {t["type"] for t in config["store"]["tiers"]}
    if "redis" in types:
        redis = request.getfixturevalue("redis_server")
        for t in config["store"]["tiers"]:
            if t["type"] == "redis":
                services[re.match(r"redis://([^/]+)", t["url"]).group(1)] = f"127.0.0.1:{redis.port}"
    if "s3" in types:
        s3 = request.getfixturevalue("s3_server")
        for t in config["store"]["tiers"]:
            if t["type"] == "s3":
                s3.create_bucket(t["bucket"])
        env.update(AWS_ENDPOINT_URL=s3.endpoint_url, AWS_ACCESS_KEY_ID=s3.access_key,
                   AWS_SECRET_ACCESS_KEY=s3.secret_key)  # what the Secret kvtier-s3 holds
    # the ConfigMap as the pod sees it: each key a file in the config volume's mount
    (config_volume,) = [v["name"] for v in pod["volumes"] if v.get("configMap", {}).get("name") == "kvtier-serve"]
    (mount,) = [m["mountPath"] for m in serve["volumeMounts"] if m["name"] == config_volume]
    etc = Path(_local_path(mount, root))
    etc.mkdir(parents=True)
    for key, text in cm["data"].items():
        (etc / key).write_text(yaml.safe_dump(_localize_config(yaml.safe_load(text), root, services)))
    _node_dirs(pod, root)

    argv = [_local_path(a, root) for a in _argv("kvtier", serve)]
    assert argv[:2] == ["kvtier", "serve"]
    proc = subprocess.Popen([str(kvtier_image / "bin" / argv[0]), *argv[1:]], cwd=root, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        ready = _wait_line(proc, "kvtier serve: ready on ")
        metrics = ready.partition(", metrics http://")[2]
        assert metrics, ready
        probe = serve["readinessProbe"]["httpGet"]["path"]
        assert _get(f"http://{metrics}{probe}")[0] == 200
        assert _get(f"http://{metrics}{serve['livenessProbe']['httpGet']['path']}")[0] == 200
        assert metrics.rsplit(":", 1)[0] == "127.0.0.1" and annotations["prometheus.io/scrape"] == "true"
        status, text = _get(f"http://{metrics}{annotations['prometheus.io/path']}")
        assert status == 200 and re.search(r"^kvtier_\w+", text, re.M), text[:500]
    finally:
        code, err = _stop(proc)
    assert code == 0, err[-3000:]
    assert "Traceback" not in err, err[-3000:]


# -- kvtier pull -----------------------------------------------------------------------------
@pytest.mark.s3
def test_every_pull_in_the_manifests_fills_the_node_cache(kvtier_image, s3_server, tmp_path_factory):
    """Each ``kvtier pull`` container (preloader, init containers, the rwx-cache Job) against
    SeaweedFS, the Secret's variables set: exit 0, the model at the path the engines read
    (``cache_path``), the files byte-equal; a second pull into the same cache finds it there."""
    from kvtier.loader.cache import cache_path

    pulls = _kvtier_commands("pull")
    assert {f for f, _, _ in pulls} >= {"deploy/kubernetes/base/preloader.yaml", "deploy/kubernetes/base/vllm.yaml",
                                        "deploy/kubernetes/base/router.yaml",
                                        "deploy/kubernetes/overlays/rwx-cache/preload-job.yaml"}
    assert {image for _, image, _ in pulls} == {"kvtier"}
    files = {"config.json": json.dumps({"model_type": "llama"}).encode(), "model.safetensors": _safetensors(),
             "tokenizer.json": b"{}"}
    client = s3_server.client()
    uploaded = set()
    env = _env(AWS_ENDPOINT_URL=s3_server.endpoint_url, AWS_ACCESS_KEY_ID=s3_server.access_key,
               AWS_SECRET_ACCESS_KEY=s3_server.secret_key)
    for rel, _image, argv in pulls:
        uri = argv[1]
        bucket, _, prefix = uri.removeprefix("s3://").partition("/")
        if uri not in uploaded:
            s3_server.create_bucket(bucket)
            for name, data in files.items():
                client.put_object(Bucket=bucket, Key=prefix + name, Body=data)
            uploaded.add(uri)
        root = tmp_path_factory.mktemp("pull")
        local = [_local_path(a, root) for a in argv]
        cache_dir = local[local.index("--cache-dir") + 1]
        for attempt in ("first", "cached"):
            out = _run([str(kvtier_image / "bin" / "kvtier"), *local], cwd=root, env=env, timeout=120)
            assert "Traceback" not in out.stderr, (rel, out.stderr[-2000:])
            path = json.loads(out.stdout)["path"] if "--json" in local else out.stdout.strip().splitlines()[-1]
            assert path == cache_path(cache_dir, uri), (rel, path)
            for name, data in files.items():
                assert (Path(path) / name).read_bytes() == data, (rel, name)
            if "--json" in local:
                assert json.loads(out.stdout)["downloaded"] is (attempt == "first"), (rel, attempt, out.stdout)


def _safetensors() -> bytes:
    """A valid one-tensor safetensors file (header built by hand: no torch needed)."""
    header = json.dumps({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}).encode()
    header += b" " * (-len(header) % 8)
    return len(header).to_bytes(8, "little") + header + bytes(16)


# -- the kvtier-vllm image: extras, light imports, kvtier route --------------------------------
def test_vllm_image_extras_and_light_modules(kvtier_vllm_image):
    """The target's extras installed without vLLM (none of them needs it); the modules vLLM's
    plugin loader and the engine's config read first import; the connector itself needs vLLM."""
    python = str(kvtier_vllm_image / "bin" / "python")
    _run([sys.executable, "-m", "pip", "--python", python, "check"], env=_env())
    code = ("import importlib.util as u, json\n"
            "import kvtier.integrations.vllm.plugin, kvtier.integrations.vllm.config, kvtier.route.proxy\n"
            "from kvtier.integrations.vllm.config import ConnectorConfig\n"
            "ConnectorConfig.from_extra_config({'server': 'unix:///run/kvtier/kvtier.sock'})\n"
            "print(json.dumps({'vllm': u.find_spec('vllm') is not None}))")
    out = _run([python, "-c", code], cwd="/", env=_env())
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"vllm": False}


class _StubEngine(http.server.ThreadingHTTPServer):
    """A tiny vLLM stand-in: /health 200, /v1/models, /v1/completions answering with its name."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.completions = 0
        super().__init__(("127.0.0.1", 0), _StubHandler)
        threading.Thread(target=self.serve_forever, args=(0.05,), daemon=True).start()  # quick shutdown

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _StubHandler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

    def _json(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/health":
            self._json({})
        elif self.path == "/v1/models":
            self._json({"object": "list", "data": [{"id": "llama-3.1-8b-instruct", "object": "model"}]})
        else:
            self.send_error(404)

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.completions += 1
        self._json({"object": "text_completion", "engine": self.server.name, "model": body.get("model"),
                    "choices": [{"index": 0, "text": " ok", "finish_reason": "length"}]})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _word_tokenizer(path: Path) -> None:
    """A word-level tokenizer saved as transformers reads it (nothing is downloaded)."""
    tokenizers = pytest.importorskip("tokenizers")
    pytest.importorskip("transformers")
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    tok = tokenizers.Tokenizer(WordLevel({**{f"w{i}": i for i in range(100)}, "[UNK]": 100}, unk_token="[UNK]"))
    tok.pre_tokenizer = WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(str(path))


def test_route_help_and_the_router_container_starts(kvtier_vllm_image, tmp_path_factory):
    """``kvtier route --help``; then router.yaml's container command with its engines replaced
    by two stub engines (by position), its event endpoints by free local ports, its tokenizer
    path under a temporary root: ready line, /health 200 once the engines are in, a completion
    relayed to a stub, /metrics, SIGTERM -> exit 0."""
    kvtier = str(kvtier_vllm_image / "bin" / "kvtier")
    out = _run([kvtier, "route", "--help"], env=_env())
    assert "--engine" in out.stdout and "Traceback" not in out.stderr

    ((rel, image, argv),) = _kvtier_commands("route")
    assert image == "kvtier-vllm", rel
    root = tmp_path_factory.mktemp("router")
    stubs = [_StubEngine("a"), _StubEngine("b")]
    port = _free_port()
    remote_engines = [argv[i + 1] for i, a in enumerate(argv) if a == "--engine"]
    assert len(remote_engines) == len(stubs), remote_engines
    hosts = {re.match(r"https?://([^/]+)", u).group(1).split(":")[0]: s for u, s in zip(remote_engines, stubs)}
    local = []
    for i, a in enumerate(argv):
        prev = argv[i - 1] if i else ""
        if prev == "--engine":
            a = hosts[re.match(r"https?://([^:/]+)", a).group(1)].url
        elif prev in ("--kv-events", "--kv-replay"):
            a = f"tcp://127.0.0.1:{_free_port()}"
        elif prev == "--host":
            a = "127.0.0.1"
        elif prev == "--port":
            a = str(port)
        local.append(_local_path(a, root))
    tokenizer = Path(local[local.index("--tokenizer") + 1])
    _word_tokenizer(tokenizer)
    assert local[0] == "route"
    proc = subprocess.Popen([kvtier, *local], cwd=root, env=_env(HOME=str(root), HF_HOME=str(root / "hf")),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _wait_line(proc, "kvtier route: ready on ", timeout=120)
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while _get(base + "/health")[0] != 200:
            assert time.monotonic() < deadline, _get(base + "/health")
            time.sleep(0.2)
        request = urllib.request.Request(
            base + "/v1/completions", method="POST", headers={"Content-Type": "application/json"},
            data=json.dumps({"model": "llama-3.1-8b-instruct", "prompt": "w1 w2 w3 w4", "max_tokens": 1}).encode())
        with urllib.request.urlopen(request, timeout=30) as r:
            answer = json.loads(r.read())
        assert answer["engine"] in ("a", "b") and sum(s.completions for s in stubs) == 1
        status, text = _get(base + "/metrics")
        assert status == 200 and "kvtier_route" in text, text[:500]
    finally:
        code, err = _stop(proc)
        for s in stubs:
            s.shutdown()
            s.server_close()
    assert code == 0, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
