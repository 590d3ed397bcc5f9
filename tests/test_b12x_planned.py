"""``doctor``'s "prewarm plans" column for b12x (issue 44 item 7, in part): the kernel functions it
names as planned are those prewarm's b12x planners reach, found by running them.

Each planner (``--linear-backend b12x``, ``--moe-backend b12x``) runs as ``check`` runs it, in the b12x
venv, with a watcher on every compile our hook meets that walks the stack to the b12x kernel function
(a site of doctor's b12x scan) that asked for it. Nothing compiles: planning records keys only.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_b12x import B12X_PY, TIMEOUT_S, _env, b12x_python  # noqa: E402,F401

pytestmark = pytest.mark.skipif(B12X_PY == "off", reason="CUTE_DISKCACHE_B12X_PYTHON=off: b12x tests skipped")

_REACHED = """
    import json, os, sys
    from pathlib import Path
    from cute_diskcache import prewarm
    from cute_diskcache.core import through
    from cute_diskcache.b12x_sites import adapter, scan

    root = adapter.package_dir()
    kernels = {(s["file"], s["function"]) for s in scan.scan(Path(root)) if s["role"] == "kernel"}
    reached = set()
    real = through.through_cache

    def watch(site, call, *args, **kwargs):
        # the innermost b12x frame that is one of doctor's kernel functions asked for this compile
        frame = sys._getframe(1)
        while frame is not None:
            code = frame.f_code
            if code.co_filename.startswith(root + os.sep):
                where = (os.path.relpath(code.co_filename, root).replace(os.sep, "/"),
                         code.co_qualname.replace(".<locals>", ""))
                if where in kernels:
                    reached.add(":".join(where))
                    break
            frame = frame.f_back
        else:
            reached.add("(no kernel function)")
        return real(site, call, *args, **kwargs)

    through.through_cache = watch  # the hook calls it by this name at each compile
    model, flag = sys.argv[1], sys.argv[2]
    args = prewarm.build_parser().parse_args([model, "--target", "rtx-pro-6000", flag, "b12x"])
    if flag == "--linear-backend":
        from cute_diskcache.prewarm import b12x as planner
        dense, counts = planner.resolve(args)
        planner.requests(args, dense, counts)
    else:
        from cute_diskcache.prewarm import b12x_moe as planner
        layer, mode, counts = planner.resolve(args)
        planner.requests(args, layer, mode, counts)
    report = scan.report()
    planned = {f"{s['file']}:{s['function']}": s["planned"] for s in report["sites"] if s["role"] == "kernel"}
    print(json.dumps({"reached": sorted(reached), "planned": planned, "doctor": scan.render(report)}))
"""


def _reached(python: str, tmp_path: Path, model: str, flag: str) -> dict[str, object]:
    root = tmp_path / model / "root"
    root.parent.mkdir(parents=True)
    proc = subprocess.run([python, "-c", textwrap.dedent(_REACHED), model, flag], env=_env(root, {}), capture_output=True,
                          text=True, timeout=TIMEOUT_S, cwd=str(root.parent))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert not root.exists(), "planning compiles and writes nothing"
    out: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def test_doctor_names_as_planned_exactly_the_kernel_functions_prewarm_reaches(b12x_python: str, tmp_path: Path) -> None:
    """Every kernel function doctor calls planned is reached by a planner with the flag it names, and
    every function a planner reaches is called planned: the NVFP4 linear (llama-3.1-8b-nvfp4) and the
    NVFP4 MoE (qwen3-30b-a3b: the micro and the dynamic kernel), at vLLM's default token counts. The
    rest, paged attention among them, doctor calls not planned."""
    by_flag: dict[str, set[str]] = {}
    planned: dict[str, str | None] = {}
    doctor: list[str] = []
    for model, flag in (("llama-3.1-8b-nvfp4", "--linear-backend"), ("qwen3-30b-a3b", "--moe-backend")):
        out = _reached(b12x_python, tmp_path, model, flag)
        by_flag.setdefault(flag, set()).update(out["reached"])  # type: ignore[arg-type]
        planned, doctor = out["planned"], out["doctor"]  # type: ignore[assignment]
    reached = set().union(*by_flag.values())
    assert reached and "(no kernel function)" not in reached, by_flag
    assert {site for site, flags in planned.items() if flags} == reached, (planned, by_flag)
    for flag, sites in by_flag.items():
        assert all(str(planned[site]).startswith(f"{flag} b12x") for site in sites), (flag, sites, planned)
    assert planned["attention/paged/_forward.py:paged_attention_forward"] is None
    # doctor's text (without --all) lists each planned function with its flags, and counts the rest
    for site in reached:
        assert any(site in line and str(planned[site]) in line for line in doctor), (site, doctor)
    assert any(f"{len(reached)} of {len(planned)} kernel functions" in line for line in doctor), doctor


_PAGED = """
    import json, types, torch
    from cute_diskcache.b12x_sites import planning
    planning.init_worker("rtx-pro-6000")  # b12x's GPU-less compile environment, as prewarm's workers
    from b12x.attention import paged

    said = {}
    try:  # vLLM's decode plan sizing, on the only device a CPU box has
        paged.decode_graph_capacity(device=torch.device("cpu"), q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16,
                                    num_q_heads=32, num_kv_heads=4, head_dim_qk=128, head_dim_vo=128, page_size=128,
                                    batch=1, max_cache_page_count=320, window_left=-1)
        said["cpu"] = "planned"
    except Exception as exc:
        said["cpu"] = f"{type(exc).__name__}: {exc}"
    try:  # vLLM's extend warm-up: paged.compile on a heuristic binding of real tensors
        paged.compile(binding=types.SimpleNamespace(plan=None, q=torch.zeros((1, 32, 128), dtype=torch.bfloat16)))
        said["compile"] = "compiled"
    except Exception as exc:
        said["compile"] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(said))
"""


def test_b12x_paged_attention_is_not_plannable_on_a_cpu_for_the_reasons_the_survey_gives(b12x_python: str,
                                                                                          tmp_path: Path) -> None:
    """docs/versions.md's B12X attention row says why prewarm does not plan it, read from b12x 1.5.1:
    its paged planning refuses a non-CUDA device, and ``paged.compile`` (what vLLM 0.34's extend
    warm-up calls) reads ``fake_mode`` off the binding's query, which a real tensor lacks. A b12x that
    changes either fails here: the row's reason, and doctor's "no", are then to be looked at again."""
    root = tmp_path / "root"
    proc = subprocess.run([b12x_python, "-c", textwrap.dedent(_PAGED)], env=_env(root, {}), capture_output=True, text=True,
                          timeout=TIMEOUT_S, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-4000:]
    said = json.loads(proc.stdout.strip().splitlines()[-1])
    assert said["cpu"] == "ValueError: decode CUDA-graph capacity requires a CUDA device", said
    assert said["compile"] == "AttributeError: 'Tensor' object has no attribute 'fake_mode'", said
