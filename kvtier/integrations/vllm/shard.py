"""``kvtier shard``: write vLLM's pre-sharded layout by letting vLLM itself cut the model.

Which bytes a tensor-parallel rank holds is decided by vLLM's model code: fused projections
(``qkv_proj``, ``gate_up_proj``), padded vocabularies, per-architecture rules. So the shards are
not guessed from tensor names: a vLLM engine is started with ``tensor_parallel_size=N`` and the
kvtier load format's ``save_shards_to`` option, so every rank streams the checkpoint, and saves
its own parameters as soon as they are loaded (vLLM's ``save_sharded_state`` on a running engine
would miss the linear weights its CPU backend repacks). The output directory then holds
``model-rank-{rank}-part-{part}.safetensors``, the model's config and tokenizer files, and
``kvtier-shard.json`` (written last: its presence means the directory is complete). It loads with
``--load-format kvtier`` (each rank streams only its own files) or vLLM's ``sharded_state``.

The engine runs in a child process (``python -m kvtier.integrations.vllm.shard``), its log kept in
the output directory only when it fails. On a CPU host each rank gets its own share of the
CPUs unless ``VLLM_CPU_OMP_THREADS_BIND`` says otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable

from kvtier.errors import ConfigError, LoaderError
from kvtier.loader.shard import MANIFEST_NAME, ShardedLayout

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".index.json")
_PHASE = "KVTIER-SHARD-PHASE "
PHASES = ("start vLLM, load and save each rank's shards", "copy config files")


@dataclass(frozen=True)
class ShardJob:
    """What to shard: a local model directory, the TP world size, the output directory."""

    model: str
    out: str
    tp: int
    max_part_bytes: int = 5 * 1000**3

    def check(self) -> None:
        """Raise ConfigError on arguments that cannot work, before any engine starts."""
        if self.tp < 1:
            raise ConfigError(f"--tp must be at least 1, got {self.tp}")
        if self.max_part_bytes < 1:
            raise ConfigError(f"--max-part-size must be positive, got {self.max_part_bytes}")
        if not os.path.isfile(os.path.join(self.model, "config.json")):
            raise ConfigError(f"{self.model}: not a model directory with a config.json")
        if os.path.abspath(self.model) == os.path.abspath(self.out):
            raise ConfigError("--out must differ from the model directory")
        if os.path.isdir(self.out) and ShardedLayout.find(os.listdir(self.out), self.out) is not None:
            raise ConfigError(f"{self.out}: already holds pre-sharded files; choose an empty directory")


def check_checkpoint(model: str, endpoint_url: str | None = None) -> int:
    """Validate every safetensors header of ``model`` (a local directory or an ``s3://`` prefix)
    before an engine is started or a byte of weights is pulled; return the number of files.

    Raises LoaderError("<file>: <problem>") on the first missing, unreadable or malformed file, as
    ``kvtier load`` does, so a broken checkpoint fails in seconds instead of after an engine start.
    A tensor name in two files is an error too, unless the model is itself a pre-sharded layout
    (whose ranks repeat names by design).
    """
    from kvtier.loader.reader import check_model, list_dir

    sharded = ShardedLayout.find(list_dir(model, endpoint_url), where=model) is not None
    return len(check_model(model, endpoint_url, unique_names=not sharded))


def cpu_bind(tp: int, cpus: list[int]) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` giving each of ``tp`` ranks its own contiguous share of ``cpus``."""
    if len(cpus) < tp:
        raise ConfigError(f"--tp {tp} needs at least {tp} CPUs on a CPU host; {len(cpus)} are available")
    share = len(cpus) // tp
    groups = [cpus[r * share:(r + 1) * share] for r in range(tp)]
    return "|".join(",".join(map(str, g)) for g in groups)


def shard(job: ShardJob, on_phase: Callable[[str], None] | None = None) -> dict:
    """Run the sharding engine in a child process; return the manifest written to ``job.out``.

    ``on_phase`` is called with each phase name of ``PHASES`` as it starts. Every header of the
    checkpoint is validated first (``check_checkpoint``). Raises LoaderError
    with the engine's last error line (its whole log is left in ``job.out``) when it fails.
    """
    job.check()
    check_checkpoint(job.model)  # a malformed header fails here, not in the engine
    os.makedirs(job.out, exist_ok=True)
    log_path = os.path.join(job.out, "kvtier-shard.log")
    cmd = [sys.executable, "-m", "kvtier.integrations.vllm.shard", json.dumps(asdict(job))]
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        for line in proc.stdout or ():
            log.write(line)
            if line.startswith(_PHASE) and on_phase:
                on_phase(line[len(_PHASE):].strip())
        rc = proc.wait()
    if rc != 0:
        raise LoaderError(f"kvtier shard: the vLLM engine failed ({_last_error(log_path)}); log: {log_path}")
    os.unlink(log_path)
    with open(os.path.join(job.out, MANIFEST_NAME)) as f:
        manifest = json.load(f)
    manifest["seconds"] = time.perf_counter() - start
    return manifest


def _last_error(log_path: str) -> str:
    """The last line of the log that looks like an error, for a one-line message."""
    with open(log_path, errors="replace") as f:
        lines = [l.strip() for l in f if l.strip()]
    for line in reversed(lines):
        if "Error" in line or "error" in line:
            return line[-300:]
    return lines[-1][-300:] if lines else "no output"


def _copy_config_files(src: str, out: str) -> list[str]:
    """Copy every file of ``src`` but the weights (config, tokenizer, generation config, code)."""
    copied = []
    for name in sorted(os.listdir(src)):
        path = os.path.join(src, name)
        if os.path.isfile(path) and not name.endswith(_WEIGHT_SUFFIXES) and not name.startswith("."):
            shutil.copy2(path, os.path.join(out, name))
            copied.append(name)
    return copied


def _run_engine(job: ShardJob) -> None:
    """Child process: start vLLM with TP=N, save each rank's shards, copy config, write the manifest."""
    print(_PHASE + PHASES[0], flush=True)
    from vllm import LLM
    from vllm.platforms import current_platform

    kwargs: dict = {}
    if current_platform.is_cpu():
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        if job.tp > 1:
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_bind(job.tp, sorted(os.sched_getaffinity(0))))
        kwargs.update(gpu_memory_utilization=0.3, num_gpu_blocks_override=8)
    extra = {"save_shards_to": job.out, "max_part_size": job.max_part_bytes}
    llm = LLM(model=job.model, tensor_parallel_size=job.tp, load_format="kvtier", model_loader_extra_config=extra,
              skip_tokenizer_init=True, max_model_len=256, enforce_eager=True,
              distributed_executor_backend="mp" if job.tp > 1 else None, **kwargs)
    print(_PHASE + PHASES[1], flush=True)
    copied = _copy_config_files(job.model, job.out)
    layout = ShardedLayout.find(os.listdir(job.out), job.out)
    if layout is None or layout.tp_size != job.tp:
        raise LoaderError(f"{job.out}: vLLM did not write shards for {job.tp} ranks")
    manifest = {"source": os.path.abspath(job.model), "tensor_parallel_size": job.tp,
                "files": sorted(n for files in layout.files.values() for n in files), "config_files": copied}
    tmp = os.path.join(job.out, MANIFEST_NAME + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=2)
    os.replace(tmp, os.path.join(job.out, MANIFEST_NAME))
    del llm


if __name__ == "__main__":
    _run_engine(ShardJob(**json.loads(sys.argv[1])))
