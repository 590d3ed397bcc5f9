"""docs/deploy.md's recipes, run step by step (issue 20, item 7).

No registry or cluster is reachable here, so each recipe is read from the page and its steps are
run as the platform would run them, on this box's installed stack:

* the Dockerfile: every ``ENV``, ``ARG``, ``RUN``, ``COPY --from`` and ``USER`` in order, each
  stage in a directory of its own standing in for the image's filesystem (absolute paths in
  ``ENV`` and ``COPY`` are mapped into it; a ``RUN`` names paths through those variables). ``pip
  install`` steps are skipped (the package is installed here), and ``CMD`` (vLLM on a GPU) is
  replaced by an engine-like probe driving the same flashinfer MoE kernels, as ``USER``;
* the Kubernetes manifests: the pod's ``securityContext`` (``runAsUser``, ``runAsGroup``,
  ``fsGroup``), ``env``, ``volumeMounts`` and the ``umask`` of its command, with the volume made as
  the kubelet makes an ``fsGroup`` volume (``root:<fsGroup>``, setgid, 2775);
* the network volume: its ``export`` lines, with the volume read-only, then full.

The prewarm is kept tiny (``MAX_NUM_TOKENS=16``, ``PREWARM_ARGS=--no-dense --m 1``: the one micro
kernel of m=1); the engines then run m=1 (in the image) and m=2 (another micro kernel, not in it).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _nobody import can_run_as_others, prefix, public_dir  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.skipif(can_run_as_others() is not None, reason=str(can_run_as_others()))]

PAGE = Path(__file__).resolve().parents[1] / "docs" / "deploy.md"
#: What ``docker build --build-arg`` would pass: the smallest prewarm that still compiles a kernel.
BUILD_ARGS = {"MAX_NUM_TOKENS": "16", "PREWARM_ARGS": "--no-dense --m 1"}
#: The Dockerfile recipe's, with one compile worker: by default prewarm starts one per CPU before it
#: plans, and for this one kernel the second is an interpreter importing flashinfer only to be closed.
#: (The Spark recipe passes PREWARM_ARGS to check too, which takes no --jobs.)
IMAGE_ARGS = {**BUILD_ARGS, "PREWARM_ARGS": BUILD_ARGS["PREWARM_ARGS"] + " --jobs 1"}
_OURS = re.compile(r"^(CUTE_DISKCACHE_.*|FLASHINFER_B12X_DISK_CACHE|CUTE_DSL_ARCH)$")


def recipe(name: str) -> str:
    m = re.search(rf"<!-- recipe: {re.escape(name)} -->\n```\w+\n(.*?)```", PAGE.read_text(), re.S)
    assert m, f"docs/deploy.md has no recipe {name!r}"
    return m.group(1)


def _map(value: str, fs: Path) -> str:
    """An absolute path (or a colon-separated list of them) as seen inside ``fs``."""
    if not value.startswith("/"):
        return value
    return ":".join(str(fs / part.lstrip("/")) for part in value.split(":"))


def _base_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not _OURS.match(k)}


class Image:
    """What the Dockerfile built: each stage's filesystem, the runtime's env, user and command."""

    def __init__(self, sandbox: Path) -> None:
        self.sandbox = sandbox
        self.stages: dict[str, Path] = {}
        self.env: dict[str, str] = {}
        self.user: tuple[int, int] = (0, 0)
        self.cmd: list[str] = []
        self.skipped: list[str] = []


def build(dockerfile: str, sandbox: Path, build_args: dict[str, str] = BUILD_ARGS) -> Image:
    """Run the Dockerfile's steps in order (see the module docstring), ``build_args`` as ``--build-arg``."""
    image = Image(sandbox)
    sandbox.mkdir(mode=0o755, exist_ok=True)
    lines = re.sub(r"\\\n\s*", " ", dockerfile).splitlines()
    fs = sandbox
    for line in (ln.strip() for ln in lines):
        if not line or line.startswith("#"):
            continue
        op, _, rest = line.partition(" ")
        op = op.upper()
        if op == "FROM":
            name = rest.split(" AS ")[-1].strip() if " AS " in rest else f"stage{len(image.stages)}"
            fs = sandbox / name
            fs.mkdir(mode=0o755)
            image.stages[name] = fs
            image.env, image.user = {}, (0, 0)
        elif op == "ARG":
            key, _, default = rest.partition("=")
            if image.stages:  # an ARG before the first FROM only feeds FROM lines
                image.env[key] = build_args.get(key, shlex.split(default)[0] if default.strip() else "")
        elif op == "ENV":
            for pair in shlex.split(rest):
                key, _, value = pair.partition("=")
                image.env[key] = _map(value, fs)
        elif op == "RUN":
            if rest.startswith("pip install"):
                image.skipped.append(line)
                continue
            env = {**_base_env(), **image.env}
            cmd = ["sh", "-ec", rest]
            if image.user[0] != 0:
                cmd = prefix(image.user[0], image.user[1], stage=_stage_dir(sandbox)) + cmd
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=fs)
            assert proc.returncode == 0, f"{line}\n--- stdout ---\n{proc.stdout[-3000:]}\n--- stderr ---\n{proc.stderr[-3000:]}"
        elif op == "COPY":
            words = shlex.split(rest)
            source = next(w.split("=", 1)[1] for w in words if w.startswith("--from="))
            src, dst = [w for w in words if not w.startswith("--")]
            target = Path(_map(dst, fs))
            target.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
            shutil.copytree(_map(src, image.stages[source]), target, symlinks=True)  # as COPY: root's, modes kept
        elif op == "USER":
            uid, _, gid = rest.strip().partition(":")
            image.user = (int(uid), int(gid or uid))
        elif op == "CMD":
            image.cmd = json.loads(rest)
        else:
            raise AssertionError(f"the recipe test does not know {op}: teach it, or keep the recipe to these steps")
    return image


def _stage_dir(sandbox: Path) -> Path:
    d = sandbox / ".bind-stage"
    d.mkdir(exist_ok=True)
    return d


def engine(
    hook_dir: Path,
    env: dict[str, str],
    *ms: int,
    uid: int,
    gid: int,
    groups: tuple[int, ...] = (),
    sandbox: Path,
    setup: str = "",
    umask: str | None = None,
) -> dict[str, Any]:
    """The engine stand-in: a fresh probe (flashinfer's MoE on the recipe's target) as ``uid``."""
    from conftest import TARGET, run_probe

    assert env["CUTE_DISKCACHE_DIR"].startswith(str(sandbox))
    return run_probe(
        hook_dir,
        env["CUTE_DISKCACHE_DIR"],
        *ms,
        extra_env=env,
        args=("--max-num-tokens", BUILD_ARGS["MAX_NUM_TOKENS"]),
        prefix=prefix(uid, gid, groups, stage=_stage_dir(sandbox), setup=setup, umask=umask),
    ) | {"target": TARGET}


def _tree(path: Path) -> dict[str, tuple[int, int, int]]:
    return {str(p.relative_to(path)): (p.stat().st_size, p.stat().st_uid, p.stat().st_mode) for p in sorted(Path(path).rglob("*"))}


def _entries(path: Path | str) -> int:
    return len(list(Path(path).glob("v1/*/*/*/manifest.msgpack")))


@pytest.fixture(scope="module")
def sandbox() -> Iterator[Path]:
    d = public_dir("cdc-recipes-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def hook(sandbox: Path, compile_hook_dir: Path) -> Path:
    """The compile counter, where uid 10001 can read it (pytest's tmp is root's 0700)."""
    d = sandbox / "hook"
    d.mkdir(mode=0o755)
    shutil.copy(compile_hook_dir / "sitecustomize.py", d / "sitecustomize.py")
    return d


@pytest.fixture(scope="module")
def image(sandbox: Path) -> Image:
    return build(recipe("dockerfile"), sandbox / "docker", IMAGE_ARGS)


def test_dockerfile_bakes_a_cache_a_non_root_user_serves(image: Image, hook: Path, sandbox: Path) -> None:
    assert image.skipped and all("cute-diskcache" in s for s in image.skipped)
    baked = image.env["CUTE_DISKCACHE_READ_DIRS"]
    assert _entries(baked) == 1, "--m 1 --no-dense: the micro kernel of m=1"
    assert os.stat(baked).st_uid == 0 and image.user[0] != 0 and image.cmd[:2] == ["vllm", "serve"]
    before = _tree(Path(baked))
    report = engine(hook, image.env, 1, uid=image.user[0], gid=image.user[1], sandbox=sandbox)
    assert report["real_compiles"] == 0 and report["counters"]["hits"] == 1, report["stderr"]
    assert "WARNING" not in report["stderr"], report["stderr"]
    assert _tree(Path(baked)) == before and _entries(image.env["CUTE_DISKCACHE_DIR"]) == 0
    print(report["stderr"])


def _pod(manifests: str) -> dict[str, Any]:
    import yaml

    [deployment] = [d for d in yaml.safe_load_all(manifests) if d and d["kind"] == "Deployment"]
    return dict(deployment["spec"]["template"]["spec"])


def test_kubernetes_replicas_share_an_fsgroup_volume_over_the_baked_image(image: Image, hook: Path, sandbox: Path) -> None:
    pod = _pod(recipe("kubernetes"))
    sc = pod["securityContext"]
    [container] = pod["containers"]
    [mount] = container["volumeMounts"]
    umask = re.search(r"umask (\d+)", " ".join(container.get("command", [])))
    fs = image.stages["runtime"]
    volume = sandbox / "k8s-volume"  # what the kubelet makes of the PVC with fsGroup
    volume.mkdir()
    os.chown(volume, 0, sc["fsGroup"])
    volume.chmod(0o2775)
    env = {e["name"]: (str(volume) if e["value"] == mount["mountPath"] else _map(e["value"], fs)) for e in container["env"]}
    env["HOME"] = image.env["HOME"]
    run = dict(gid=sc["runAsGroup"], groups=(sc["fsGroup"],), sandbox=sandbox, umask=umask.group(1) if umask else None)

    first = engine(hook, env, 1, 2, uid=sc["runAsUser"], **run)  # m=2: a kernel the image lacks
    assert first["counters"]["hits"] == 1 and first["real_compiles"] == 1 and first["counters"]["writes"] == 1, first["stderr"]
    assert "refuses" not in first["stderr"] and "cannot" not in first["stderr"], first["stderr"]
    assert _entries(volume) == 1
    print(first["stderr"])

    home = sandbox / "home-of-another-uid"  # its own container's HOME (flashinfer writes its log there)
    home.mkdir()
    os.chown(home, sc["runAsUser"] + 1, sc["runAsGroup"])
    other_uid = engine(hook, env | {"HOME": str(home)}, 1, 2, uid=sc["runAsUser"] + 1, **run)  # a replica under another uid
    assert other_uid["real_compiles"] == 0 and other_uid["counters"]["hits"] == 2, other_uid["stderr"]

    without = {k: v for k, v in env.items() if k != "CUTE_DISKCACHE_TRUST_GROUP"}
    refused = engine(hook, without, 1, uid=sc["runAsUser"], **run)
    assert refused["real_compiles"] == 0 and refused["counters"]["hits"] == 1, "the baked layer still serves"
    [line] = [ln for ln in refused["stderr"].splitlines() if "refuses cache root" in ln]
    assert f"CUTE_DISKCACHE_TRUST_GROUP={sc['fsGroup']}" in line, line
    print(line)


@pytest.mark.parametrize("trouble", ["read-only", "full"])
def test_network_volume_read_only_or_full_keeps_serving_with_one_warning(image: Image, hook: Path, sandbox: Path, trouble: str) -> None:
    exports = dict(re.findall(r"^export (\w+)=(\S+)$", recipe("network-volume"), re.M))
    fs = image.stages["runtime"]
    mount_point = sandbox / f"netvol-{trouble}"
    env = {k: _map(v, fs) for k, v in exports.items()}
    env["CUTE_DISKCACHE_DIR"] = str(mount_point / Path(exports["CUTE_DISKCACHE_DIR"]).name)
    env["HOME"] = image.env["HOME"]
    uid, gid = image.user
    mount_point.mkdir()
    os.chown(mount_point, uid, gid)
    if trouble == "read-only":
        setup = f'mount --bind "{mount_point}" "{mount_point}" && mount -o remount,bind,ro "{mount_point}"'
    else:
        setup = f'mount -t tmpfs -o size=64k,uid={uid},gid={gid},mode=755 tmpfs "{mount_point}"'
    report = engine(hook, env, 1, 2, uid=uid, gid=gid, sandbox=sandbox, setup=setup)
    assert report["counters"]["hits"] == 1 and report["real_compiles"] == 1 and report["counters"]["writes"] == 0, report["stderr"]
    lines = [ln for ln in report["stderr"].splitlines() if "cannot write" in ln or "refuses" in ln]
    assert len(lines) == 1, report["stderr"]
    assert ("read-only" in lines[0]) if trouble == "read-only" else ("disk full" in lines[0] or "No space" in lines[0]), lines
    print(lines[0])


def _emulation() -> Any:
    from _compat import script

    return script("emulated_aarch64")


def test_dgx_spark_image_built_on_x86_serves_an_aarch64_engine(hook: Path, sandbox: Path) -> None:
    """Recipe 4: the build stage on this x86 box (cross-built aarch64 entries, gated by check for a
    Spark host), the runtime's engine in an emulated aarch64 Python as the image's user."""
    emulation = _emulation()
    if emulation.unavailable():
        pytest.skip(emulation.unavailable())
    image = build(recipe("dgx-spark"), sandbox / "spark")
    assert image.skipped and all("cute-diskcache" in s for s in image.skipped)
    baked = Path(image.env["CUTE_DISKCACHE_READ_DIRS"])
    assert _entries(baked) == 1, "--m 1 --no-dense: the micro kernel of m=1"
    [namespace] = [p.name for p in (baked / "v1").iterdir()]
    assert "-sm_121a-aarch64-" in namespace, namespace
    [obj] = baked.glob("v1/*/*/*/object-*.o")
    assert int.from_bytes(obj.read_bytes()[18:20], "little") == 183, "aarch64 host code"
    assert image.user[0] != 0 and image.cmd[:2] == ["vllm", "serve"]

    # The engine: aarch64, as uid 10001. Root's home (where the emulated environment lives) is
    # closed to that uid, so the environment is shown through a bind mount in its namespace.
    python = Path(emulation.build())
    view = sandbox / "aarch64-env"
    view.mkdir(mode=0o755)
    uid, gid = image.user
    run_as = prefix(uid, gid, stage=_stage_dir(sandbox), setup=f'mount --bind "{python.parents[2]}" "{view}"')
    before = _tree(baked)
    report = emulation.probe(view / "venv" / "bin" / "python", image.env["CUTE_DISKCACHE_DIR"], [1], hook,
                             max_num_tokens=int(BUILD_ARGS["MAX_NUM_TOKENS"]), extra_env=image.env, prefix=run_as)
    assert report["real_compiles"] == 0 and report["counters"]["hits"] == 1 and report["counters"]["compiles"] == 0, report["stderr"][-3000:]
    assert report["records"][0]["launch_error"].endswith("expected device_type=cuda"), report["records"][0]["launch_error"]
    assert "WARNING" not in report["stderr"], report["stderr"][-3000:]
    assert _tree(baked) == before and _entries(image.env["CUTE_DISKCACHE_DIR"]) == 0
    print(report["stderr"])
