"""The container images (Dockerfile: CPU, Dockerfile.cuda: CUDA), checked without a builder.

No container daemon runs on the machines this project is tested on, so the images are not built
here. What can be checked without one is: every file a COPY names exists and is not excluded by
.dockerignore; the images install exactly the repository's pins (torch's pin is requirements.txt's,
then requirements.txt with constraints.txt, then scripts/check_pins.py, which this test runs against
the test environment); the package and its recipes go in; the final user is numeric and not root;
the command is the console script.
"""

from __future__ import annotations

import fnmatch
import json
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = ["Dockerfile", "Dockerfile.cuda"]
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def instructions(name: str) -> list[tuple[str, str]]:
    """(KEYWORD, arguments) of each instruction, continuation lines joined, comments dropped."""
    out, pending = [], ""
    for raw in (ROOT / name).read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):  # a comment inside a continued instruction
            continue
        pending += line[:-1] + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            keyword, _, args = pending.partition(" ")
            out.append((keyword.upper(), " ".join(args.split())))
            pending = ""
    assert not pending, f"{name} ends inside a continued instruction"
    return out


def of(name: str, keyword: str) -> list[str]:
    return [args for kw, args in instructions(name) if kw == keyword]


def pins(path: str) -> dict[str, str]:
    found = {}
    for line in (ROOT / path).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep, f"{path}: {line!r} is not an exact pin"
            found[re.sub(r"\[.*\]", "", name).lower()] = version
    return found


def ignored(path: str) -> bool:
    patterns = [p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines()
                if p.strip() and not p.startswith("#")]
    parts = Path(path).parts
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    return any(fnmatch.fnmatch(p, pat.removeprefix("**/")) or fnmatch.fnmatch(p, pat)
               for p in prefixes for pat in patterns)


@pytest.mark.parametrize("name", DOCKERFILES)
def test_every_copied_file_exists_and_reaches_the_build_context(name):
    copies = of(name, "COPY")
    assert copies
    for args in copies:
        assert "--from" not in args, args
        *sources, _dest = args.split()
        for src in sources:
            assert (ROOT / src).exists(), f"{name}: COPY {src}: no such file in the repository"
            assert not ignored(src), f"{name}: COPY {src}: excluded by .dockerignore"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_the_images_install_exactly_the_repository_pins(name):
    requirements, constraints = pins("requirements.txt"), pins("constraints.txt")
    assert all(constraints.get(k) == v for k, v in requirements.items()), "requirements.txt and constraints.txt differ"
    (base,) = of(name, "FROM")
    python = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    match = re.fullmatch(r"python:(3\.\d+)\.\d+-slim-[a-z]+(@sha256:[0-9a-f]{64})?", base)
    assert match, f"{name}: base {base!r} is not pinned to a Python patch release"
    assert f">={match.group(1)}" in python, f"{name}: base Python {match.group(1)} outside {python}"
    runs = " && ".join(of(name, "RUN"))
    torch = re.findall(r'"torch==([^"]+)"', runs)
    assert torch == [requirements["torch"]], f"{name}: installs torch {torch}, requirements.txt pins it at " \
                                             f"{requirements['torch']}"
    assert "pip install -r requirements.txt -c constraints.txt" in runs
    assert "pip install --no-deps ." in runs  # the package itself adds no unpinned dependency
    assert "python scripts/check_pins.py constraints.txt" in runs and "pip check" in runs
    index = re.search(r"TORCH_INDEX=(\S+)", " ".join(of(name, "ARG"))).group(1)
    assert (index == CPU_INDEX) == (name == "Dockerfile"), f"{name}: torch from {index}"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_the_images_carry_the_package_with_its_recipes(name):
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {setuptools["package-dir"].get(p.split(".")[0], p.split(".")[0]) for p in setuptools["packages"]}
    copied = {args.split()[0] for args in of(name, "COPY")}
    assert folders <= copied, f"{name}: not copied: {sorted(folders - copied)}"
    assert {"pyproject.toml", "README.md"} <= {s for args in of(name, "COPY") for s in args.split()[:-1]}
    assert "diloco-async recipes" in " ".join(of(name, "RUN"))  # the installed tool finds them at build time


@pytest.mark.parametrize("name", DOCKERFILES)
def test_the_images_run_as_a_numeric_user_that_is_not_root(name):
    steps = instructions(name)
    users = [i for i, (kw, _) in enumerate(steps) if kw == "USER"]
    assert users, f"{name}: no USER: the image would run as root"
    last_user, last_run = users[-1], max(i for i, (kw, _) in enumerate(steps) if kw == "RUN")
    assert last_user > last_run, f"{name}: a RUN after the last USER"
    uid = steps[last_user][1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, f"{name}: USER {uid!r} (numeric and not 0, for runAsNonRoot)"
    runs = " ".join(of(name, "RUN"))
    assert f"--uid {uid}" in runs and f"chown -R {uid}:" in runs, f"{name}: user {uid} not created or owns nothing"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_the_command_is_the_console_script_and_the_workers_command_is_not_wrapped(name):
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert not of(name, "ENTRYPOINT"), f"{name}: an ENTRYPOINT would wrap the Prefect worker's command"
    (cmd,) = of(name, "CMD")
    program = json.loads(cmd)[0]
    assert program in scripts and scripts[program] == "diloco_async.flows.cli:main", (program, scripts)


def test_the_cuda_image_differs_from_the_cpu_image_only_in_torch():
    cpu, cuda = instructions("Dockerfile"), instructions("Dockerfile.cuda")
    same = ("FROM", "COPY", "USER", "CMD", "WORKDIR")
    assert [s for s in cpu if s[0] in same] == [s for s in cuda if s[0] in same]
    cuda_runs = " ".join(of("Dockerfile.cuda", "RUN"))
    assert " ".join(of("Dockerfile", "RUN")).replace("constraints.txt && pip check",
                                                   "constraints.txt --allow-closure-of torch && pip check") == cuda_runs
