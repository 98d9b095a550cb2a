"""The container image's Dockerfile, read structurally (Docker cannot run here), and the
helper scripts and docs of deploy/."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import yaml
from k8s_manifests import REPO, kustomizations

DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile"
DOCKERIGNORE = REPO / "deploy" / "docker" / "Dockerfile.dockerignore"
VLLM_DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile.vllm"
ENSURE_KUBECTL = REPO / "deploy" / "tools" / "ensure-kubectl.sh"


def instructions(dockerfile=DOCKERFILE) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    joined, current = [], ""
    for line in dockerfile.read_text().splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        joined.append(current + line)
        current = ""
    assert not current, "the Dockerfile ends inside a continued line"
    parsed = []
    for line in joined:
        word, _, rest = line.strip().partition(" ")
        parsed.append((word.upper(), rest.strip()))
    return parsed


def stages(dockerfile=DOCKERFILE) -> list[list[tuple[str, str]]]:
    """The instructions of each build stage; stage 0 holds what precedes the first FROM."""
    found: list[list[tuple[str, str]]] = [[]]
    for instruction in instructions(dockerfile):
        if instruction[0] == "FROM":
            found.append([])
        found[-1].append(instruction)
    return found


def arg_defaults(stage: list[tuple[str, str]]) -> dict[str, str]:
    pairs = [rest.partition("=") for word, rest in stage if word == "ARG"]
    return {name: value for name, _, value in pairs}


def pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def test_base_image_is_a_cuda_build_argument():
    preamble, *built = stages()
    base = arg_defaults(preamble).get("BASE_IMAGE", "")
    assert "cuda" in base, f"ARG BASE_IMAGE before the first FROM, a CUDA image: {base!r}"
    for stage in built:
        image = stage[0][1].split()[0]
        assert image in ("${BASE_IMAGE}", "$BASE_IMAGE"), f"FROM {image}: not the build argument"


def test_image_installs_pdxfer_with_nixl_and_existing_extras():
    project = pyproject()["project"]
    assert any(re.match(r"nixl\b", dep) for dep in project["dependencies"])
    build, final = stages()[1], stages()[-1]
    installs = [rest for word, rest in build if word == "RUN" and "pip install" in rest]
    assert any(re.search(r"""pip install ["']?\.(\$|\[|["'\s]|$)""", r) for r in installs), installs
    extras = arg_defaults(build).get("PDXFER_EXTRAS", "")
    for extra in filter(None, extras.split(",")):
        assert extra in project["optional-dependencies"], f"PDXFER_EXTRAS names {extra!r}"
    venv = re.search(r"python3 -m venv (\S+)", " ".join(rest for _, rest in build)).group(1)
    copied = [rest for word, rest in final if word == "COPY" and rest.startswith("--from=")]
    assert any(rest.split()[1:] == [venv, venv] for rest in copied), (
        "the venv never reaches the image"
    )


@pytest.mark.parametrize("dockerfile", [DOCKERFILE, VLLM_DOCKERFILE], ids=lambda p: p.name)
def test_runs_as_the_numeric_non_root_user_the_manifests_expect(dockerfile):
    users = [rest for word, rest in stages(dockerfile)[-1] if word == "USER"]
    assert users, "no USER: the image would run as root"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and int(uid) > 0, f"USER {users[-1]}: runAsNonRoot needs a numeric uid"
    expected = set()
    for path in (REPO / "deploy" / "k8s").rglob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            expected |= set(_values(doc, "runAsUser"))
    assert expected == {int(uid)}, f"manifests run as {expected}, the image as {uid}"


def _values(node, key: str):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from [v] if k == key else _values(v, key)
    elif isinstance(node, list):
        for item in node:
            yield from _values(item, key)


def test_entrypoint_is_the_pdxfer_console_script():
    entrypoints = [rest for word, rest in stages()[-1] if word == "ENTRYPOINT"]
    assert entrypoints and yaml.safe_load(entrypoints[-1]) == ["pdxfer"], entrypoints
    assert "pdxfer" in pyproject()["project"]["scripts"]


@pytest.mark.parametrize("dockerfile", [DOCKERFILE, VLLM_DOCKERFILE], ids=lambda p: p.name)
def test_copy_sources_exist_and_are_sent_to_the_build(dockerfile):
    # BuildKit reads <Dockerfile>.dockerignore beside each Dockerfile.
    ignore = dockerfile.with_name(dockerfile.name + ".dockerignore")
    patterns = [p.strip() for p in ignore.read_text().splitlines()]
    patterns = [p for p in patterns if p and not p.startswith("#")]
    assert patterns[0] == "*", "the .dockerignore should start from nothing"
    included = {p[1:].rstrip("/") for p in patterns if p.startswith("!")}
    sources = []
    for word, rest in instructions(dockerfile):
        if word == "COPY" and not rest.startswith("--from="):
            sources += [s for s in rest.split()[:-1] if not s.startswith("--")]
    assert sources
    for source in sources:
        assert (REPO / source).exists(), f"COPY {source}: not in the repository"
        assert source.rstrip("/") in included, f"COPY {source}: excluded by {ignore.name}"


def test_vllm_image_is_the_official_vllm_image_at_a_build_argument_tag():
    preamble, *built = stages(VLLM_DOCKERFILE)
    args = arg_defaults(preamble)
    assert args.get("VLLM_IMAGE") == "vllm/vllm-openai", args
    assert "VLLM_TAG" in args, "the tag is a build argument"
    assert [stage[0][1].split()[0] for stage in built] == ["${VLLM_IMAGE}:${VLLM_TAG}"]


def test_vllm_image_pip_installs_pdxfer_without_replacing_vllms_torch():
    (stage,) = stages(VLLM_DOCKERFILE)[1:]
    (install,) = [rest for word, rest in stage if word == "RUN" and "pip install" in rest]
    assert re.search(r"""pip install .*["']\.(\$|\[|["'\s]|$)""", install), install
    # torch and triton pinned to what the base holds, and the connector importable.
    assert "--constraint" in install and "torch" in install and "triton" in install
    assert "import transfer.vllm" in install
    extras = arg_defaults(stage).get("PDXFER_EXTRAS", "")
    for extra in filter(None, extras.split(",")):
        assert extra in pyproject()["project"]["optional-dependencies"], extra


def test_ensure_kubectl_is_valid_sh_and_passes_when_kubectl_exists():
    subprocess.run(["sh", "-n", str(ENSURE_KUBECTL)], check=True, timeout=30)
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl not on PATH: running the script here would install it")
    subprocess.run(["sh", str(ENSURE_KUBECTL)], check=True, timeout=30)


def test_readme_covers_every_overlay():
    readme = (REPO / "deploy" / "README.md").read_text()
    for name, path in kustomizations().items():
        relative = path.relative_to(REPO).as_posix()
        assert relative in readme, f"deploy/README.md does not mention {relative} ({name})"
