"""Engine thread binding (``kvtier.harness.cpus``): what every engine of the tests and benchmarks gets."""

from __future__ import annotations

import pytest

from kvtier.harness.cpus import THREADS_ENV, engine_cpu_env


def test_an_engine_gets_every_core_split_among_its_ranks():
    assert engine_cpu_env(1, {}, [0, 1]) == {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "OMP_NUM_THREADS": "2"}
    assert engine_cpu_env(2, {}, [0, 1]) == {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "OMP_NUM_THREADS": "1"}
    assert engine_cpu_env(2, {}, [0, 1, 2, 3, 4]) == {"VLLM_CPU_OMP_THREADS_BIND": "0-1|2-3", "OMP_NUM_THREADS": "2"}
    assert engine_cpu_env(1, {}, [3, 5]) == {"VLLM_CPU_OMP_THREADS_BIND": "3,5", "OMP_NUM_THREADS": "2"}
    assert engine_cpu_env(1, {}, [1, 1, 0]) == {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "OMP_NUM_THREADS": "2"}


def test_the_loaded_suite_caps_each_rank():
    assert engine_cpu_env(1, {THREADS_ENV: "1"}, [0, 1]) == {"VLLM_CPU_OMP_THREADS_BIND": "0", "OMP_NUM_THREADS": "1"}
    assert engine_cpu_env(2, {THREADS_ENV: "1"}, [0, 1, 2, 3]) == {"VLLM_CPU_OMP_THREADS_BIND": "0|1",
                                                                   "OMP_NUM_THREADS": "1"}
    assert engine_cpu_env(1, {THREADS_ENV: "8"}, [0, 1])["OMP_NUM_THREADS"] == "2"  # a cap, never more


@pytest.mark.parametrize("tp, env, cores, says", [
    (2, {}, [0], "needs at least 2 cores"),
    (1, {THREADS_ENV: "0"}, [0, 1], "positive number"),
    (1, {THREADS_ENV: "two"}, [0, 1], "positive number"),
    (1, {THREADS_ENV: "\u00b2"}, [0, 1], "positive number"),  # a superscript two: isdigit() says yes
    (1, {THREADS_ENV: " 2"}, [0, 1], "positive number"),
])
def test_impossible_bindings_are_one_line(tp, env, cores, says):
    with pytest.raises(ValueError, match=says):
        engine_cpu_env(tp, env, cores)


def test_the_cpu_hog_caps_the_engines_of_its_command(tmp_path):
    """``python -m kvtier.harness.cpu_hog -- CMD`` runs CMD with one engine thread per rank."""
    import subprocess
    import sys

    out = tmp_path / "env.txt"
    code = f"import os; open({str(out)!r}, 'w').write(os.environ.get({THREADS_ENV!r}, ''))"
    assert subprocess.call([sys.executable, "-m", "kvtier.harness.cpu_hog", "--procs", "0", "--",
                            sys.executable, "-c", code]) == 0
    assert out.read_text() == "1"
