"""deploy/ as an operator meets it, checked without a Docker daemon or a cluster: the Dockerfile
and .dockerignore are parsed and held to the image's rules, compose.yaml is validated against
the Compose Specification's JSON schema (vendored), and the Kubernetes manifests against
Kubernetes' own schemas (kubernetes-validate, offline)."""

from __future__ import annotations

import re
import shlex
import subprocess
import tomllib
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]
IMAGE = f"inherent:{VERSION}"
# The oldest Kubernetes release the manifests promise to work on, and the newest known.
KUBERNETES_VERSIONS = ["1.30.0", kubernetes_validate.latest_version()]


def pinned_torch() -> str:
    pins = [d for d in PYPROJECT["project"]["dependencies"] if d.startswith("torch")]
    assert len(pins) == 1 and pins[0].startswith("torch=="), pins
    return pins[0].removeprefix("torch==")


# ---------------------------------------------------------------------------------------------
# Dockerfile
# ---------------------------------------------------------------------------------------------


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def args(self, keyword: str) -> list[str]:
        return [a for k, a in self.instructions if k == keyword]


def parse_dockerfile(text: str) -> list[Stage]:
    """Instructions (continuations joined, comments dropped) grouped by stage."""
    logical, pending = [], ""
    for line in text.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.lstrip().startswith("#"):
            continue  # a comment inside a continued instruction
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    stages: list[Stage] = []
    for line in logical:
        keyword, _, rest = line.strip().partition(" ")
        keyword, rest = keyword.upper(), " ".join(rest.split())
        if keyword == "FROM":
            words = rest.split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else ""
            stages.append(Stage(name, words[0]))
        else:
            stages[-1].instructions.append((keyword, rest))
    return stages


STAGES = parse_dockerfile((DEPLOY / "Dockerfile").read_text())
BY_NAME = {s.name: s for s in STAGES}


def chain(stage: Stage) -> list[Stage]:
    """The stage and the stages it is built FROM, base first."""
    return ([*chain(BY_NAME[stage.base]), stage]) if stage.base in BY_NAME else [stage]


def inherited(stage: Stage, keyword: str) -> list[str]:
    return [a for s in chain(stage) for a in s.args(keyword)]


def env_of(stage: Stage) -> dict[str, str]:
    env: dict[str, str] = {}
    for line in inherited(stage, "ENV"):
        for word in shlex.split(line):
            key, _, value = word.partition("=")
            env[key] = value
    return env


def arg_default(stage: Stage, name: str) -> str:
    for line in stage.args("ARG"):
        key, _, value = line.partition("=")
        if key == name:
            return value
    raise AssertionError(f"stage {stage.name} has no ARG {name}")


def build_stage_of(stage: Stage) -> Stage:
    """The stage a runtime stage copies its virtualenv from."""
    for line in stage.args("COPY"):
        if line.endswith("/opt/venv /opt/venv"):
            return BY_NAME[re.search(r"--from=(\S+)", line).group(1)]
    raise AssertionError(f"stage {stage.name} copies no /opt/venv")


RUNTIME = [BY_NAME["cpu"], BY_NAME["gpu"]]


def test_the_default_target_is_the_cpu_image():
    assert STAGES[-1].name == "cpu"


def test_base_images_are_pinned_to_a_full_version():
    external = [s.base for s in STAGES if s.base not in BY_NAME]
    assert external
    for image in external:
        tag = image.partition(":")[2]
        assert tag and tag != "latest", f"{image} is not pinned"
        assert re.match(r"\d+\.\d+\.\d+", tag), f"{image}: pin a full version, not {tag!r}"


def test_the_cpu_image_takes_cpu_only_torch_from_pytorchs_cpu_index():
    build = build_stage_of(BY_NAME["cpu"])
    assert arg_default(build, "TORCH_VERSION") == pinned_torch()
    assert arg_default(build, "TORCH_INDEX_URL") == "https://download.pytorch.org/whl/cpu"
    torch_installs = [r for r in build.args("RUN") for part in r.split("&&") if "torch==" in part]
    assert torch_installs and all('--index-url "$TORCH_INDEX_URL"' in r for r in torch_installs)


def test_the_gpu_target_has_the_gpu_extra_and_pypis_cuda_torch():
    build = build_stage_of(BY_NAME["gpu"])
    runs = " ".join(build.args("RUN"))
    assert "-e '.[gpu]'" in runs
    assert "TORCH_INDEX_URL" not in runs and "whl/cpu" not in runs
    assert arg_default(build, "TORCH_VERSION") == pinned_torch()


def test_no_stage_installs_the_dev_extras():
    for stage in STAGES:
        for run in stage.args("RUN"):
            assert "dev]" not in run and "setup.sh" not in run, f"{stage.name}: {run}"


def test_kernels_are_compiled_at_build_time_where_the_runtime_finds_them():
    cpu = BY_NAME["cpu"]
    build = build_stage_of(cpu)
    apt = " ".join(inherited(build, "RUN"))
    assert re.search(r"apt-get install .*\bg\+\+", apt) and "ninja-build" in apt
    assert any("ensure_built()" in r for r in build.args("RUN"))
    extensions = env_of(build)["TORCH_EXTENSIONS_DIR"]
    assert env_of(cpu)["TORCH_EXTENSIONS_DIR"] == extensions
    assert any(
        line.startswith(f"--from={build.name} ") and line.endswith(f"{extensions} {extensions}")
        for line in (c.replace("--chown=inherent:inherent ", "") for c in cpu.args("COPY"))
    )
    # The compiler stays in the runtime image (the base): a node whose CPU differs from the
    # build host's builds its own copy (-march=native); docs/deploy.md says why.
    assert "g++" in " ".join(inherited(BY_NAME["base"], "RUN"))


@pytest.mark.parametrize("stage", RUNTIME, ids=lambda s: s.name)
def test_runtime_stages_run_unprivileged_with_a_healthcheck_and_a_data_volume(stage):
    users = inherited(stage, "USER")
    assert users and users[-1] not in ("root", "0"), users
    assert stage.args("USER"), "USER must be set in the runtime stage itself"
    health = inherited(stage, "HEALTHCHECK")
    assert health and "/readyz" in health[-1]
    data_dir = env_of(stage)["INHERENT_DATA_DIR"]
    assert any(data_dir in v for v in inherited(stage, "VOLUME"))
    assert inherited(stage, "CMD")[-1] == '["inherent", "serve"]'


def dockerignore_patterns() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def ignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: a path is left out when it or a folder above it matches a pattern."""
    assert not any(p.startswith("!") for p in patterns), "exceptions are not modelled here"
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pattern in patterns:
        regex = re.escape(pattern).replace(r"\*\*/", "(.*/)?").replace(r"\*", "[^/]*")
        if any(re.fullmatch(regex, prefix) for prefix in prefixes):
            return True
    return False


def test_the_build_context_leaves_out_host_state():
    patterns = dockerignore_patterns()
    for path in (
        ".git/HEAD",
        ".venv/bin/python",
        ".inherent/inherent.db",
        ".inherent/vectors/x",
        "engine/__pycache__/model.cpython-311.pyc",
        ".pytest_cache/v/cache",
        ".ruff_cache/0.6/x",
        "inherent.egg-info/PKG-INFO",
    ):
        assert ignored(path, patterns), f"{path} would enter the image"


def test_every_copied_path_is_in_a_clean_clone_and_in_the_context():
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    patterns = dockerignore_patterns()
    copied = [
        word
        for stage in STAGES
        for line in stage.args("COPY")
        if "--from=" not in line
        for word in line.split()[:-1]
        if not word.startswith("--")
    ]
    assert {"pyproject.toml", "migrations", "engine"} <= set(copied)
    for source in copied:
        inside = [f for f in tracked if f == source or f.startswith(source + "/")]
        assert inside, f"COPY {source}: not in a clean clone"
        assert not all(ignored(f, patterns) for f in inside), f"COPY {source}: .dockerignore drops it"
    # Everything a runtime needs from the tree: the packages and the Alembic chain.
    for package in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]:
        assert package.rstrip("*") in copied


# ---------------------------------------------------------------------------------------------
# Compose
# ---------------------------------------------------------------------------------------------

COMPOSE = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
SERVICES = COMPOSE["services"]
OURS = {n: s for n, s in SERVICES.items() if s.get("image", "").startswith("inherent:")}


def test_compose_validates_against_the_compose_specification():
    schema = yaml.safe_load((DEPLOY / "schemas" / "compose-spec.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(COMPOSE), key=str)
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors)


def test_compose_catches_what_the_schema_forbids():
    """The validation can fail: a misspelt key is reported."""
    schema = yaml.safe_load((DEPLOY / "schemas" / "compose-spec.json").read_text())
    broken = {"services": {"api": {"image": IMAGE, "restart_policy": "always"}}}
    assert list(jsonschema.Draft7Validator(schema).iter_errors(broken))


def test_compose_runs_one_image_built_once():
    assert set(OURS) == {"migrate", "api", "worker"}
    assert {s["image"] for s in OURS.values()} == {IMAGE}
    builders = [n for n, s in OURS.items() if "build" in s]
    assert builders == ["migrate"]
    assert all(s.get("pull_policy") == "never" for n, s in OURS.items() if n != "migrate")
    assert OURS["migrate"]["build"]["dockerfile"] == "deploy/Dockerfile"


def test_compose_restarts_and_checks_the_health_of_every_service():
    for name, service in SERVICES.items():
        assert service.get("restart") in ("unless-stopped", "always", "on-failure"), name
        health = service.get("healthcheck", {})
        if name == "migrate":  # a one-shot job: its exit status is what others wait on
            assert health == {"disable": True}
            continue
        assert health.get("test"), f"{name} has no healthcheck"
    for name in ("api", "worker"):
        assert OURS[name]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
        assert all(
            d["condition"] != "service_started" for d in OURS[name]["depends_on"].values()
        ), name


def test_compose_migrates_once_and_workers_use_the_solo_pool():
    assert OURS["migrate"]["command"] == ["inherent", "db", "upgrade"]
    env = OURS["api"]["environment"]
    assert env["INHERENT_MIGRATE_ON_START"] == "false"
    worker = OURS["worker"]["command"]
    assert worker[:4] == ["celery", "-A", "ingest.celery_app", "worker"]
    assert "--pool=solo" in worker
    # Each API or worker container keeps its own /data: no named volume shared between them.
    for name in ("api", "worker"):
        assert not any(str(v).endswith(":/data") for v in OURS[name].get("volumes", [])), name


def test_the_qdrant_server_matches_qdrant_client():
    client = metadata.version("qdrant-client").split(".")[:2]
    tag = SERVICES["qdrant"]["image"].partition(":")[2]
    assert tag.lstrip("v").split(".")[:2] == client, (tag, client)


def test_other_compose_images_are_pinned():
    for name, service in SERVICES.items():
        if name not in OURS:
            assert re.search(r":v?\d+\.\d+", service["image"]), service["image"]  # postgres: major.minor is a release


# ---------------------------------------------------------------------------------------------
# Kubernetes
# ---------------------------------------------------------------------------------------------

MANIFESTS = sorted((DEPLOY / "kubernetes").glob("*.yaml"))
RESOURCES = [d for path in MANIFESTS for d in yaml.safe_load_all(path.read_text()) if d]
CUSTOM_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}


def resource(kind: str, name: str) -> dict:
    found = [r for r in RESOURCES if r["kind"] == kind and r["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def pod_specs() -> list[tuple[str, dict]]:
    return [
        (r["metadata"]["name"], r["spec"]["template"]["spec"])
        for r in RESOURCES
        if r["kind"] in ("Deployment", "Job")
    ]


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_manifests_validate_against_kubernetes_schemas(version):
    checked = 0
    for doc in RESOURCES:
        if (doc["apiVersion"], doc["kind"]) in CUSTOM_KINDS:
            continue
        kubernetes_validate.validate(doc, version, strict=True)
        checked += 1
    assert checked >= 7


def test_kubernetes_validation_can_fail():
    job = resource("Job", f"inherent-migrate-{VERSION}")
    broken = {**job, "spec": {**job["spec"], "backofLimit": 6}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSIONS[-1], strict=True)


def test_images_are_pinned_and_containers_have_resources_and_run_unprivileged():
    for name, spec in pod_specs():
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        for container in spec["containers"]:
            assert container["image"] == IMAGE, f"{name}: {container['image']}"
            assert container["resources"]["requests"]["memory"], name
            assert container["resources"]["limits"]["memory"], name
            assert container["securityContext"]["allowPrivilegeEscalation"] is False
            sources = {k for ref in container["envFrom"] for k in ref}
            assert sources == {"configMapRef", "secretRef"}, name
            # Each pod has its own data dir, never a volume shared with another pod.
            data = [m for m in container["volumeMounts"] if m["mountPath"] == "/data"]
            assert data, name
            volumes = {v["name"]: v for v in spec["volumes"]}
            assert "emptyDir" in volumes[data[0]["name"]], name


def test_secrets_hold_the_database_url_and_keys_and_none_is_committed():
    assert not [r for r in RESOURCES if r["kind"] == "Secret"]
    config = resource("ConfigMap", "inherent-config")["data"]
    assert not {"INHERENT_DATABASE_URL", "INHERENT_REDIS_URL", "INHERENT_QDRANT_API_KEY"} & set(config)
    assert config["INHERENT_MIGRATE_ON_START"] == "false"
    header = (DEPLOY / "kubernetes" / "config.yaml").read_text()
    for key in ("INHERENT_DATABASE_URL", "INHERENT_REDIS_URL", "INHERENT_QDRANT_API_KEY"):
        assert f"--from-literal={key}" in header


def test_the_api_has_probes_a_drain_window_and_scales():
    deployment = resource("Deployment", "inherent-api")
    spec = deployment["spec"]["template"]["spec"]
    (api,) = spec["containers"]
    startup, ready, live = api["startupProbe"], api["readinessProbe"], api["livenessProbe"]
    assert startup["httpGet"]["path"] == "/healthz"
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300  # model load + kernels
    assert ready["httpGet"]["path"] == "/readyz" and live["httpGet"]["path"] == "/healthz"
    grace = float(resource("ConfigMap", "inherent-config")["data"]["INHERENT_SHUTDOWN_GRACE_S"])
    pre_stop = int(api["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert spec["terminationGracePeriodSeconds"] > pre_stop + grace + 5
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0

    labels = deployment["spec"]["selector"]["matchLabels"]
    assert resource("PodDisruptionBudget", "inherent-api")["spec"]["selector"]["matchLabels"] == labels
    hpa = resource("HorizontalPodAutoscaler", "inherent-api")["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "inherent-api"}
    assert hpa["minReplicas"] >= 2
    service = resource("Service", "inherent-api")["spec"]
    assert service["selector"] == labels
    monitor = resource("ServiceMonitor", "inherent-api")["spec"]
    service_labels = resource("Service", "inherent-api")["metadata"]["labels"]
    assert monitor["selector"]["matchLabels"].items() <= service_labels.items()
    assert {e["port"] for e in monitor["endpoints"]} <= {p["name"] for p in service["ports"]}
    assert {e["path"] for e in monitor["endpoints"]} == {"/metrics"}


def test_the_migration_job_runs_the_upgrade_once_and_workers_use_the_solo_pool():
    job = resource("Job", f"inherent-migrate-{VERSION}")["spec"]["template"]["spec"]
    assert job["containers"][0]["command"] == ["inherent", "db", "upgrade"]
    assert job["restartPolicy"] == "OnFailure"
    worker = resource("Deployment", "inherent-worker")["spec"]["template"]["spec"]["containers"][0]
    assert "--pool=solo" in worker["command"]
    assert worker["startupProbe"] and worker["livenessProbe"]
    assert resource("PodDisruptionBudget", "inherent-worker")
