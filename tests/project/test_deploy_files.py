"""The deployment files hold together without a container registry or a cluster (neither is
reachable here): docker/Dockerfile installs jaxserve from the build context with extras that
pyproject.toml defines, its targets exist, run as a non-root user, check /health and start
`jaxserve serve` on 0.0.0.0; every document of deploy/kubernetes/*.yaml survives a round trip
through the Kubernetes API's model classes (the `kubernetes` client's: an unknown or misspelled
field is dropped, a wrong type refused; a LeaderWorkerSet, a CRD the client has no class for,
has its own fields checked against its v1 API and its pod templates round-tripped); every
jaxserve and smg command line in them parses with the programs' own parsers; probes ask
/health and /ready; grace periods outlast the drain; names that refer to each other (Service
selectors, ports, volumes, the slice's hosts, the router's workers) agree; and the multi-host
slice mounts its host-link key from a Secret. The last tests feed each check a broken input,
so that a check that could never fail would show."""

from __future__ import annotations

import contextlib
import fnmatch
import io
import json
import pathlib
import re
import shlex

import pytest
import yaml

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest's own dependency
    import tomli as tomllib

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "docker" / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
MANIFESTS = sorted((ROOT / "deploy" / "kubernetes").glob("*.yaml"))
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
EXTRAS = PYPROJECT["project"]["optional-dependencies"]
SERVE_TARGETS = {"cpu": set(), "cuda": {"cuda"}, "tpu": {"tpu"}}  # target -> its extras
WORKLOADS = ("Deployment", "StatefulSet", "Job", "LeaderWorkerSet")
DRAIN_MARGIN_S = 10  # past the drain: the last chunks' flush and the process's exit
SAMPLE_ENV = {"apps.kubernetes.io/pod-index": "0", "status.podIP": "10.0.0.1"}
LWS_API = "leaderworkerset.x-k8s.io/v1"
# The LeaderWorkerSet v1 API (sigs.k8s.io/lws api/leaderworkerset/v1): its fields, and the
# model classes of those that are Kubernetes' own types.
LWS_SPEC = {"replicas": int, "leaderWorkerTemplate": dict, "rolloutStrategy": dict,
            "startupPolicy": ("LeaderCreated", "LeaderReady"), "networkConfig": dict}
LWS_TEMPLATE = {"leaderTemplate": "V1PodTemplateSpec", "workerTemplate": "V1PodTemplateSpec",
                "size": int, "restartPolicy": ("RecreateGroupOnPodRestart",
                                               "RecreateGroupAfterStart", "None", "Default"),
                "subGroupPolicy": dict, "volumeClaimTemplates": "V1PersistentVolumeClaim",
                "persistentVolumeClaimRetentionPolicy":
                    "V1StatefulSetPersistentVolumeClaimRetentionPolicy"}
LWS_ROLLOUT = {"type": ("RollingUpdate",), "rollingUpdateConfiguration": dict}
LWS_NETWORK = {"subdomainPolicy": ("Shared", "UniquePerReplica")}


# ---- Dockerfile ----------------------------------------------------------------------------

def dockerfile_stages(text: str) -> dict[str, dict]:
    """Stage name -> {"parent": the FROM (a stage name or an image), "lines": [(INSTRUCTION,
    arguments)]}, continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n(\s*#[^\n]*\n)*", " ", text)
    stages: dict[str, dict] = {}
    current = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        instruction, _, rest = line.partition(" ")
        instruction, rest = instruction.upper(), rest.strip()
        if instruction == "FROM":
            match = re.fullmatch(r"(?:--\S+\s+)*(\S+)\s+AS\s+(\S+)", rest, re.I)
            assert match, f"every stage is named (FROM image AS name): {line!r}"
            current = stages[match[2]] = {"parent": match[1], "lines": []}
        elif current is not None:
            current["lines"].append((instruction, rest))
    return stages


def effective(stages: dict[str, dict], target: str, instruction: str) -> list[str]:
    """The arguments of every `instruction` that applies to target, its parents' first."""
    chain = []
    name = target
    while name in stages:
        chain.append(stages[name])
        name = stages[name]["parent"]
    return [rest for stage in reversed(chain) for ins, rest in stage["lines"]
            if ins == instruction]


def exec_form(arguments: str) -> list[str]:
    value = json.loads(arguments)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), arguments
    return value


def pip_requirements(run: str) -> list[list[str]]:
    """The requirement arguments of each `pip install` in a RUN line (options dropped)."""
    found = []
    for segment in re.split(r"&&|\|\||;", run):
        words = shlex.split(segment)
        for i in range(len(words) - 1):
            if re.fullmatch(r"(\S*/)?pip3?", words[i]) and words[i + 1] == "install":
                found.append([w for w in words[i + 2:] if not w.startswith("-")])
                break
    return found


def pinned_requirements() -> dict[str, str]:
    """Requirement name -> its whole specifier, as pyproject.toml states it anywhere."""
    pins = {}
    for requirement in [*PYPROJECT["project"]["dependencies"], *sum(EXTRAS.values(), [])]:
        name = re.match(r"[A-Za-z0-9_.-]+", requirement)[0].lower()
        pins[name] = requirement.replace(" ", "")
    return pins


def requirement_problems(requirement: str) -> list[str]:
    """What is wrong with one `pip install` argument: a local project path (the build
    context) may name only pyproject.toml's extras; anything else must be pinned as
    pyproject.toml pins it, and never be PyPI's unrelated `jaxserve`."""
    path = re.fullmatch(r"((?:\.|/)[^\[]*)(?:\[([^\]]*)\])?", requirement)
    if path:
        extras = {e.strip() for e in (path[2] or "").split(",") if e.strip()}
        unknown = extras - set(EXTRAS)
        return [f"{requirement}: extras {sorted(unknown)} are not in pyproject.toml's "
                f"{sorted(EXTRAS)}"] if unknown else []
    name = re.match(r"[A-Za-z0-9_.-]+", requirement)[0].lower()
    if name == "jaxserve":
        return [f"{requirement}: PyPI's `jaxserve` is an unrelated project; install the build "
                "context (`pip install \".[extra]\"`)"]
    if pinned_requirements().get(name) != requirement.replace(" ", ""):
        return [f"{requirement}: not pinned as pyproject.toml pins {name} "
                f"({pinned_requirements().get(name)})"]
    return []


def local_extras(requirements: list[str]) -> list[set[str]]:
    """The extras of each build-context requirement."""
    found = []
    for requirement in requirements:
        path = re.fullmatch(r"((?:\.|/)[^\[]*)(?:\[([^\]]*)\])?", requirement)
        if path:
            found.append({e.strip() for e in (path[2] or "").split(",") if e.strip()})
    return found


STAGES = dockerfile_stages(DOCKERFILE.read_text())


def test_dockerfile_has_the_targets():
    assert set(SERVE_TARGETS) | {"router"} <= set(STAGES), sorted(STAGES)
    for target in SERVE_TARGETS:  # each built from python:3.12-slim through `base`
        assert effective(STAGES, target, "USER") and STAGES[target]["parent"] == "base"


def test_every_pip_install_names_defined_extras_from_the_build_context():
    installs = [r for stage in STAGES.values() for ins, rest in stage["lines"] if ins == "RUN"
                for r in pip_requirements(rest)]
    assert installs, "no `pip install` found in docker/Dockerfile"
    problems = [p for requirements in installs for r in requirements
                for p in requirement_problems(r)]
    assert problems == []


@pytest.mark.parametrize("target", sorted(SERVE_TARGETS))
def test_each_target_installs_jaxserve_with_its_extra(target):
    runs = effective(STAGES, target, "RUN")
    requirements = [r for run in runs for rs in pip_requirements(run) for r in rs]
    assert local_extras(requirements) == [SERVE_TARGETS[target]], requirements
    # the bind mount of the build context that "." refers to
    assert any("--mount=type=bind" in run and "cd /src" in run for run in runs)


def test_the_router_image_runs_the_tested_smg():
    requirements = [r for run in effective(STAGES, "router", "RUN")
                    for rs in pip_requirements(run) for r in rs]
    assert requirements == [pinned_requirements()["smg"]]
    assert exec_form(effective(STAGES, "router", "ENTRYPOINT")[-1])[:2] == ["smg", "launch"]


@pytest.mark.parametrize("target", [*sorted(SERVE_TARGETS), "router"])
def test_targets_run_as_a_user_other_than_root(target):
    users = effective(STAGES, target, "USER")
    assert users, f"{target}: no USER (runs as root)"
    assert users[-1].split(":")[0] not in ("root", "0")


@pytest.mark.parametrize("target", sorted(SERVE_TARGETS))
def test_healthcheck_asks_health_without_curl(target):
    checks = effective(STAGES, target, "HEALTHCHECK")
    assert checks, f"{target}: no HEALTHCHECK"
    check = checks[-1]
    assert "/health" in check and "urllib" in check and "curl" not in check
    port = re.search(r"127\.0\.0\.1:(\d+)/health", check)[1]
    assert effective(STAGES, target, "EXPOSE") == [port]


@pytest.mark.parametrize("target", sorted(SERVE_TARGETS))
def test_entrypoint_serves_on_all_interfaces_and_takes_the_model_after_it(target):
    entrypoint = exec_form(effective(STAGES, target, "ENTRYPOINT")[-1])
    cmd = exec_form(effective(STAGES, target, "CMD")[-1])
    assert entrypoint[:2] == ["jaxserve", "serve"]
    port = int(effective(STAGES, target, "EXPOSE")[-1])
    for extra in ([], ["Qwen/Qwen2.5-0.5B-Instruct", "--max-model-len", "4096"]):
        # `docker run IMAGE MODEL FLAGS`: what follows the image replaces CMD
        args = parse_serve(entrypoint[2:] + (extra or cmd))
        assert (args.host, args.port) == ("0.0.0.0", port)
        assert args.model_tag == (extra[0] if extra else None)


@pytest.mark.parametrize("target", sorted(SERVE_TARGETS))
def test_caches_live_in_the_volume(target, monkeypatch):
    env = dict(re.findall(r"(\w+)=(\S+)", " ".join(effective(STAGES, target, "ENV"))))
    assert env["HF_HOME"] == "/cache/huggingface" and env["XDG_CACHE_HOME"] == "/cache"
    assert [exec_form(v) for v in effective(STAGES, target, "VOLUME")] == [["/cache"]]
    from jaxserve.config.engine_config import EngineConfig
    from jaxserve.config.model_path import default_model_path

    monkeypatch.setenv("XDG_CACHE_HOME", env["XDG_CACHE_HOME"])
    config = EngineConfig.create(str(default_model_path()))
    assert config.compilation_cache_dir == "/cache/jaxserve/xla"


def test_dockerignore_keeps_what_the_install_needs():
    patterns = [line.strip() for line in DOCKERIGNORE.read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    ignored = lambda path: any(fnmatch.fnmatch(path, p) for p in patterns)
    for path in (".venv", ".git", "jaxserve.egg-info", ".pytest_cache"):
        assert ignored(path), path
    packages = PYPROJECT["tool"]["setuptools"]["package-dir"].values()
    for path in ("pyproject.toml", "README.md", "LICENSE", *packages):
        assert not ignored(path), path


# ---- Kubernetes manifests ------------------------------------------------------------------

def documents() -> list[tuple[str, int, dict]]:
    return [(path.name, i, doc) for path in MANIFESTS
            for i, doc in enumerate(yaml.safe_load_all(path.read_text())) if doc]


def model_class(doc: dict) -> str:
    """apps/v1 Deployment -> V1Deployment (the client's model class name)."""
    version = doc["apiVersion"].rpartition("/")[2]
    return version[:1].upper() + version[1:] + doc["kind"]


def round_trip_problems(doc: dict) -> list[str]:
    """The document against its kind's API model: deserialized into the model class and
    serialized back, it must come out as it went in (a LeaderWorkerSet: lws_problems)."""
    if doc.get("kind") == "LeaderWorkerSet":
        return lws_problems(doc)
    return model_problems(doc, model_class(doc))


def model_problems(value: dict, name: str) -> list[str]:
    import kubernetes.client

    if not hasattr(kubernetes.client, name):
        return [f"no model class {name}"]
    api = kubernetes.client.ApiClient()
    try:
        # (the client's own deserializer, as for an API response; private in every version)
        back = api.sanitize_for_serialization(api._ApiClient__deserialize(value, name))
    except (ValueError, TypeError) as err:
        return [f"{name}: {err}"]
    return [f"{name}: {p}" for p in differences(value, back, "")]


def lws_problems(doc: dict) -> list[str]:
    """A LeaderWorkerSet against its v1 API: every field known and of its type, the pod
    templates and claims round-tripped through Kubernetes' own model classes."""
    problems = [] if doc.get("apiVersion") == LWS_API else [
        f"LeaderWorkerSet: apiVersion {doc.get('apiVersion')!r}, not {LWS_API}"]
    problems += [f"LeaderWorkerSet.{key}: unknown field" for key in
                 doc.keys() - {"apiVersion", "kind", "metadata", "spec"}]
    problems += model_problems(doc.get("metadata", {}), "V1ObjectMeta")
    spec = doc.get("spec", {})
    problems += field_problems(spec, LWS_SPEC, "spec")
    template = spec.get("leaderWorkerTemplate", {})
    if "workerTemplate" not in template:
        problems.append("spec.leaderWorkerTemplate.workerTemplate: missing")
    problems += field_problems(template, LWS_TEMPLATE, "spec.leaderWorkerTemplate")
    problems += field_problems(spec.get("rolloutStrategy", {}), LWS_ROLLOUT,
                               "spec.rolloutStrategy")
    problems += field_problems(spec.get("networkConfig", {}), LWS_NETWORK, "spec.networkConfig")
    return problems


def field_problems(value: dict, fields: dict, where: str) -> list[str]:
    """Each field of `value` against `fields`: a Python type, the allowed strings, or the
    name of a Kubernetes model class (a list field: each item's)."""
    problems = []
    for key, item in value.items():
        kind = fields.get(key)
        if kind is None:
            problems.append(f"{where}.{key}: unknown field")
        elif isinstance(kind, tuple):
            if item not in kind:
                problems.append(f"{where}.{key}: {item!r} is not one of {kind}")
        elif isinstance(kind, str):
            for part in item if isinstance(item, list) else [item]:
                problems += [f"{where}.{key}: {p}" for p in model_problems(part, kind)]
        elif type(item) is not kind:
            problems.append(f"{where}.{key}: {item!r} is not a {kind.__name__}")
    return problems


def differences(sent, back, where: str) -> list[str]:
    if isinstance(sent, dict) and isinstance(back, dict):
        return [d for key in sent.keys() | back.keys() for d in (
            [f"{where}.{key}: dropped (unknown field)"] if key not in back else
            [f"{where}.{key}: added"] if key not in sent else
            differences(sent[key], back[key], f"{where}.{key}"))]
    if isinstance(sent, list) and isinstance(back, list) and len(sent) == len(back):
        return [d for i, (s, b) in enumerate(zip(sent, back))
                for d in differences(s, b, f"{where}[{i}]")]
    return [] if sent == back and type(sent) is type(back) else \
        [f"{where}: {sent!r} came back as {back!r}"]


DOCS = documents()


def test_the_manifests_are_there():
    assert {p.name for p in MANIFESTS} >= {"single-host.yaml", "tpu-multihost.yaml",
                                          "router.yaml"}
    kinds = {(name, doc["kind"]) for name, _, doc in DOCS}
    assert {("single-host.yaml", "Deployment"), ("single-host.yaml", "Service"),
            ("tpu-multihost.yaml", "LeaderWorkerSet"), ("router.yaml", "Deployment")} <= kinds


@pytest.mark.parametrize("name,index,doc", DOCS,
                         ids=[f"{n}:{i}:{d['kind']}" for n, i, d in DOCS])
def test_document_matches_the_kubernetes_api_models(name, index, doc):
    assert round_trip_problems(doc) == []


def workloads() -> list[tuple[str, dict]]:
    return [(name, doc) for name, _, doc in DOCS if doc["kind"] in WORKLOADS]


def pod_kinds(doc: dict) -> list[dict]:
    """The workload's pods, one view per pod template: the workload itself, or for a
    LeaderWorkerSet its leader's and its workers' ({"role", "spec": {"template"}, "lws"})."""
    if doc["kind"] != "LeaderWorkerSet":
        return [doc]
    template = doc["spec"]["leaderWorkerTemplate"]
    roles = [("leader", template.get("leaderTemplate", template["workerTemplate"])),
             ("worker", template["workerTemplate"])]
    return [{"kind": "LeaderWorkerSet", "metadata": doc["metadata"], "role": role,
             "spec": {"template": pod}, "lws": doc} for role, pod in roles]


def containers() -> list[tuple[str, dict, dict]]:
    """(file, pods (pod_kinds), container) of every container."""
    return [(name, pods, c) for name, doc in workloads() for pods in pod_kinds(doc)
            for c in pods["spec"]["template"]["spec"]["containers"]]


def injected_env(pods: dict) -> dict[str, str]:
    """What a LeaderWorkerSet's controller adds to its containers' env (LWS_LEADER_ADDRESS,
    LWS_GROUP_SIZE, LWS_WORKER_INDEX), for the first group's leader or first worker."""
    if pods["kind"] != "LeaderWorkerSet":
        return {}
    lws = pods["lws"]
    name = lws["metadata"]["name"]
    return {"LWS_LEADER_ADDRESS": f"{name}-0.{name}.default",
            "LWS_GROUP_SIZE": str(lws["spec"]["leaderWorkerTemplate"]["size"]),
            "LWS_WORKER_INDEX": "0" if pods["role"] == "leader" else "1"}


def command_line(container: dict) -> list[str]:
    return [*container.get("command", []), *container.get("args", [])]


def expand(argv: list[str], container: dict,
           injected: dict | None = None) -> tuple[list[str], list[str]]:
    """Kubernetes' $(VAR) expansion with sample values for what the pod's environment fills
    in (a field reference: its sample, else the literal; `injected`: what a controller adds);
    and the names it could not find (Kubernetes would pass `$(NAME)` on unchanged)."""
    env = dict(injected or {})
    for var in container.get("env", []):
        field = var.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath", "")
        key = re.search(r"\['([^']+)'\]", field)
        env[var["name"]] = var.get("value") or SAMPLE_ENV.get(key[1] if key else field, "x")
    missing = []

    def value(match):
        if match[1] not in env:
            missing.append(match[1])
        return env.get(match[1], match[0])
    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", value, a) for a in argv], missing


def parse_serve(argv: list[str]):
    """`jaxserve serve` arguments parsed as jaxserve.cli's main parses them; fails the test on
    an error or an unrecognized argument."""
    from jaxserve.cli import build_parser

    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        try:
            args, extra = build_parser().parse_known_args(["serve", *argv])
        except SystemExit as exit_:
            pytest.fail(f"`jaxserve serve {shlex.join(argv)}` does not parse (exit "
                        f"{exit_.code}): {stderr.getvalue().strip()}")
    if extra:
        pytest.fail(f"`jaxserve serve {shlex.join(argv)}`: unrecognized arguments {extra}")
    return args


def serve_containers() -> list[tuple[str, dict, dict, object]]:
    """(file, pods (pod_kinds), container, parsed serve arguments) of every jaxserve
    container."""
    found = []
    for name, doc, container in containers():
        argv, missing = expand(command_line(container), container, injected_env(doc))
        assert missing == [], f"{name}: $({missing[0]}) is not in the container's env"
        if argv[:2] == ["jaxserve", "serve"]:
            found.append((name, doc, container, parse_serve(argv[2:])))
    return found


def test_every_jaxserve_command_parses():
    serving = serve_containers()
    assert {name for name, *_ in serving} >= {"single-host.yaml", "tpu-multihost.yaml",
                                              "router.yaml"}
    for name, pods, container, args in serving:
        assert args.host == "0.0.0.0", f"{name}: serve binds {args.host}, not the pod's IP"
        assert args.model_tag, f"{name}: no model"
        if pods.get("role") == "worker":
            continue  # (serves no HTTP: host 0 does)
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports.get("http") == args.port, f"{name}: the http port is not --port"


def mesh_devices(args) -> int:
    from jaxserve.config.mesh import MeshShape, parse_mesh

    shape = parse_mesh(args.mesh) if args.mesh else MeshShape(args.data_parallel_size,
                                                              args.tensor_parallel_size)
    return shape.num_devices


def test_each_pod_asks_for_the_devices_its_mesh_spans():
    for name, _, container, args in serve_containers():
        resources = container["resources"]
        [kind] = [k for k in ("nvidia.com/gpu", "google.com/tpu") if k in resources["limits"]]
        assert resources["requests"][kind] == resources["limits"][kind], name
        # --mesh (or -tp x -dp) over every host's devices
        assert int(resources["limits"][kind]) * (args.num_hosts or 1) == mesh_devices(args), name


def probe_target(probe: dict) -> tuple[str, object]:
    """(path, port) a probe asks: an httpGet's, or the URL inside an exec probe's command."""
    if "httpGet" in probe:
        return probe["httpGet"]["path"], probe["httpGet"]["port"]
    url = re.search(r"https?://[^/\s\"']+:(\d+)(/[\w/-]*)", " ".join(probe["exec"]["command"]))
    assert url, f"exec probe without a URL: {probe}"
    return url[2], int(url[1])


def probe_problems(container: dict, port: int) -> list[str]:
    """Readiness asks /ready, liveness and startup /health, on the server's port."""
    wanted = {"readinessProbe": "/ready", "livenessProbe": "/health", "startupProbe": "/health"}
    names = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
    problems = []
    for kind, path in wanted.items():
        if kind not in container:
            if kind != "startupProbe":
                problems.append(f"no {kind}")
            continue
        asked, asked_port = probe_target(container[kind])
        if asked != path or names.get(asked_port, asked_port) != port:
            problems.append(f"{kind} asks {asked} on {asked_port}, not {path} on {port}")
    return problems


def test_probes_ask_health_and_ready():
    for name, pods, container, args in serve_containers():
        if pods.get("role") == "worker":
            continue  # (serves no HTTP; its group restarts with its leader)
        assert probe_problems(container, args.port) == [], name
        # compilation takes minutes: liveness waits for a startup probe of 10+ minutes
        startup = container["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, name


def pre_stop_seconds(container: dict) -> int:
    """The longest `sleep N` of the preStop hook (0 without one)."""
    hook = container.get("lifecycle", {}).get("preStop", {})
    command = " ".join(hook.get("exec", {}).get("command", []))
    sleeps = [int(s) for s in re.findall(r"\bsleep\s+(\d+)", command)]
    return max(sleeps + [int(hook.get("sleep", {}).get("seconds", 0))])


def grace_problems(pod_spec: dict, container: dict, drain_s: float) -> list[str]:
    grace = pod_spec.get("terminationGracePeriodSeconds", 30)
    need = pre_stop_seconds(container) + drain_s + DRAIN_MARGIN_S
    return [] if grace >= need else [
        f"terminationGracePeriodSeconds {grace} < preStop {pre_stop_seconds(container)} s + "
        f"drain {drain_s} s + {DRAIN_MARGIN_S} s"]


def test_grace_periods_outlast_the_drain():
    for name, doc, container, args in serve_containers():
        assert args.shutdown_timeout >= 1, name
        assert grace_problems(doc["spec"]["template"]["spec"], container,
                              args.shutdown_timeout) == [], name


def test_hf_token_comes_from_a_secret_and_caches_from_a_volume():
    for name, _, container, _ in serve_containers():
        env = {v["name"]: v for v in container["env"]}
        assert "secretKeyRef" in env["HF_TOKEN"]["valueFrom"], name
        assert env["HF_HOME"]["value"] == "/cache/huggingface", name
        assert env["XDG_CACHE_HOME"]["value"] == "/cache", name
        assert any(m["mountPath"] == "/cache" for m in container["volumeMounts"]), name


def labels_match(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def pod_labels(doc: dict) -> list[dict]:
    """The labels of the pods of a workload or of one of its pod_kinds (a StatefulSet's with
    each pod's name and index, a LeaderWorkerSet's with each pod's group and worker index)."""
    if doc["kind"] == "LeaderWorkerSet" and "role" not in doc:
        return [labels for pods in pod_kinds(doc) for labels in pod_labels(pods)]
    labels = doc["spec"]["template"]["metadata"]["labels"]
    if doc["kind"] == "LeaderWorkerSet":
        lws = doc["lws"]
        size = lws["spec"]["leaderWorkerTemplate"]["size"]
        workers = [0] if doc["role"] == "leader" else range(1, size)
        return [{**labels, "leaderworkerset.sigs.k8s.io/name": lws["metadata"]["name"],
                 "leaderworkerset.sigs.k8s.io/group-index": str(group),
                 "leaderworkerset.sigs.k8s.io/worker-index": str(worker)}
                for group in range(lws["spec"].get("replicas", 1)) for worker in workers]
    if doc["kind"] != "StatefulSet":
        return [labels]
    return [{**labels, "statefulset.kubernetes.io/pod-name": f"{doc['metadata']['name']}-{i}",
             "apps.kubernetes.io/pod-index": str(i)} for i in range(doc["spec"]["replicas"])]


def reference_problems(file_docs: list[dict]) -> list[str]:
    """Names that refer to each other within one file: Service selectors and target ports,
    workload selectors, StatefulSet Services, claims, volume mounts."""
    problems = []
    loads = [d for d in file_docs if d["kind"] in WORKLOADS]
    claims = {d["metadata"]["name"] for d in file_docs if d["kind"] == "PersistentVolumeClaim"}
    services = {d["metadata"]["name"]: d for d in file_docs if d["kind"] == "Service"}
    for load in loads:
        spec, name = load["spec"], load["metadata"]["name"]
        if load["kind"] != "LeaderWorkerSet" and not labels_match(
                spec["selector"]["matchLabels"], spec["template"]["metadata"]["labels"]):
            problems.append(f"{name}: its selector does not select its own pods")
        claim_templates = (spec["leaderWorkerTemplate"] if load["kind"] == "LeaderWorkerSet"
                           else spec).get("volumeClaimTemplates", [])
        for pods in pod_kinds(load):
            pod = pods["spec"]["template"]["spec"]
            volumes = {v["name"] for v in pod.get("volumes", [])}
            volumes |= {t["metadata"]["name"] for t in claim_templates}
            for volume in pod.get("volumes", []):
                claim = volume.get("persistentVolumeClaim", {}).get("claimName")
                if claim and claim not in claims:
                    problems.append(f"{name}: claim {claim} is not in the file")
            for container in pod["containers"]:
                for mount in container.get("volumeMounts", []):
                    if mount["name"] not in volumes:
                        problems.append(f"{name}: mount of unknown volume {mount['name']}")
        if load["kind"] == "StatefulSet":
            service = services.get(spec["serviceName"])
            if not service or service["spec"].get("clusterIP") != "None":
                problems.append(f"{name}: serviceName {spec['serviceName']} is not a headless "
                                "Service of the file")
    for service in services.values():
        selected = [(pods, labels) for load in loads for pods in pod_kinds(load)
                    for labels in pod_labels(pods)
                    if labels_match(service["spec"]["selector"], labels)]
        if not selected:
            problems.append(f"Service {service['metadata']['name']} selects no pod")
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            for load, _ in selected:
                ports = [p for c in load["spec"]["template"]["spec"]["containers"]
                         for p in c.get("ports", [])]
                if not any(target in (p.get("name"), p["containerPort"]) for p in ports):
                    problems.append(f"Service {service['metadata']['name']}: no container "
                                    f"port {target} in {load['metadata']['name']}")
    return problems


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_names_refer_to_what_the_file_defines(path):
    assert reference_problems([d for d in yaml.safe_load_all(path.read_text()) if d]) == []


def test_multihost_slice_is_one_process_per_host_and_only_host_0_serves():
    """A LeaderWorkerSet group is the slice: every pod runs the same command, with the
    leader as coordinator, the group's size as host count and the pod's index as host id;
    only the leader serves HTTP, and only it is behind the Service."""
    slice_pods = [s for s in serve_containers() if s[0] == "tpu-multihost.yaml"]
    [(name, leader, container, args)] = [s for s in slice_pods if s[1]["role"] == "leader"]
    [(_, worker, worker_container, worker_args)] = [s for s in slice_pods
                                                    if s[1]["role"] == "worker"]
    lws = leader["lws"]
    template = lws["spec"]["leaderWorkerTemplate"]
    assert template["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert args.num_hosts == worker_args.num_hosts == template["size"] > 1
    assert (args.host_id, worker_args.host_id) == (0, 1)
    assert command_line(container) == command_line(worker_container)
    assert args.coordinator == injected_env(leader)["LWS_LEADER_ADDRESS"] + ":8476"
    for flag, var in (("--coordinator", "LWS_LEADER_ADDRESS"), ("--num-hosts", "LWS_GROUP_SIZE"),
                      ("--host-id", "LWS_WORKER_INDEX")):
        assert f"$({var})" in container["args"][container["args"].index(flag) + 1]
    assert {p["name"]: p["containerPort"] for p in container["ports"]}["coordinator"] == 8476
    served = [d for n, _, d in DOCS if n == name and d["kind"] == "Service" and
              d["spec"].get("clusterIP") != "None"]
    assert served
    for service in served:  # the leader's pod alone
        selected = [labels for labels in pod_labels(lws)
                    if labels_match(service["spec"]["selector"], labels)]
        assert [labels["leaderworkerset.sigs.k8s.io/worker-index"] for labels in selected] \
            == ["0"]


def key_problems(pods: dict, container: dict) -> list[str]:
    """The host-link key from a Secret (an env secretKeyRef, or a file in a mounted secret
    volume named by JAXSERVE_HOST_LINK_KEY_FILE), and the host's address from its pod IP."""
    env = {v["name"]: v for v in container.get("env", [])}
    problems = []
    if env.get("JAXSERVE_HOST_IP", {}).get("valueFrom", {}).get("fieldRef", {}).get(
            "fieldPath") != "status.podIP":
        problems.append("JAXSERVE_HOST_IP is not the pod's IP")
    if "JAXSERVE_HOST_LINK_KEY" in env:
        if "secretKeyRef" not in env["JAXSERVE_HOST_LINK_KEY"].get("valueFrom", {}):
            problems.append("JAXSERVE_HOST_LINK_KEY is not from a Secret")
        return problems
    path = env.get("JAXSERVE_HOST_LINK_KEY_FILE", {}).get("value")
    if not path:
        return problems + ["no host-link key (JAXSERVE_HOST_LINK_KEY[_FILE])"]
    secrets = {v["name"]: v["secret"] for v in pods["spec"]["template"]["spec"].get(
        "volumes", []) if "secret" in v}
    for mount in container.get("volumeMounts", []):
        folder = mount["mountPath"].rstrip("/") + "/"
        if mount["name"] in secrets and path.startswith(folder):
            secret, file = secrets[mount["name"]], path[len(folder):]
            items = secret.get("items")
            if items is not None and file not in [i["path"] for i in items]:
                problems.append(f"{path}: the Secret's volume holds no {file}")
            return problems
    return problems + [f"JAXSERVE_HOST_LINK_KEY_FILE={path} is not in a mounted Secret"]


def test_every_host_of_the_slice_gets_the_link_key_from_a_secret():
    slice_pods = [s for s in serve_containers() if s[0] == "tpu-multihost.yaml"]
    assert {pods["role"] for _, pods, _, _ in slice_pods} == {"leader", "worker"}
    for _, pods, container, _ in slice_pods:
        assert key_problems(pods, container) == [], pods["role"]
    [policy] = [d for n, _, d in DOCS if n == "tpu-multihost.yaml" and
                d["kind"] == "NetworkPolicy"]
    lws = slice_pods[0][1]["lws"]
    assert all(labels_match(policy["spec"]["podSelector"]["matchLabels"], labels)
               for labels in pod_labels(lws))
    # Others reach only the HTTP port; the group's own pods, the rest.
    ports = [rule.get("ports") for rule in policy["spec"]["ingress"] if "from" not in rule]
    assert ports == [[{"port": 8000, "protocol": "TCP"}]]


def test_router_command_parses_and_names_every_worker():
    pytest.importorskip("smg")
    from smg.launch_router import parse_router_args

    [(router_doc, router)] = [(doc, c) for name, doc, c in containers()
                              if name == "router.yaml" and command_line(c)[0] == "smg"]
    argv = command_line(router)
    assert argv[:2] == ["smg", "launch"]
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        try:
            parsed = parse_router_args(argv[2:])
        except SystemExit as exit_:
            pytest.fail(f"smg launch does not parse (exit {exit_.code}): {stderr.getvalue()}")
    [(_, workers, worker, args)] = [s for s in serve_containers() if s[0] == "router.yaml"]
    spec = workers["spec"]
    assert parsed.worker_urls == [
        f"grpc://{workers['metadata']['name']}-{i}.{spec['serviceName']}:{args.grpc_port}"
        for i in range(spec["replicas"])]
    assert parsed.model_path == args.model_tag
    ports = {p["name"]: p["containerPort"] for p in router["ports"]}
    assert ports["http"] == parsed.port and parsed.host == "0.0.0.0"
    assert router["livenessProbe"]["httpGet"]["path"] == "/liveness"
    assert router["readinessProbe"]["httpGet"]["path"] == "/readiness"
    assert grace_problems(router_doc["spec"]["template"]["spec"], router,
                          parsed.shutdown_grace_period_secs) == []


# ---- the checks fail on broken input ----------------------------------------------------

def test_the_checks_catch_broken_files():
    # pip: the unrelated PyPI project, an extra pyproject.toml lacks, an unpinned package
    assert requirement_problems("jaxserve[cuda]") and requirement_problems(".[gpu]")
    assert requirement_problems("smg") and not requirement_problems(".[cuda,tpu]")
    assert pip_requirements('cd /src && pip install --no-deps ".[cuda]"') == [[".[cuda]"]]
    # the API models: a misspelled field, a wrong type, a field in the wrong place
    _, _, deployment = next(d for d in DOCS if d[2]["kind"] == "Deployment")
    broken = json.loads(json.dumps(deployment))
    broken["spec"]["template"]["spec"]["containers"][0]["readinessprobe"] = {"x": 1}
    assert any("dropped" in p for p in round_trip_problems(broken))
    broken = json.loads(json.dumps(deployment))
    broken["spec"]["replicas"] = "one"
    assert round_trip_problems(broken)
    broken = json.loads(json.dumps(deployment))
    broken["spec"]["template"]["spec"]["containers"][0]["args"].append(8000)
    assert round_trip_problems(broken)
    broken = json.loads(json.dumps(deployment))
    broken["spec"]["template"]["spec"]["containers"][0]["terminationGracePeriodSeconds"] = 9
    assert round_trip_problems(broken)
    broken = dict(deployment, apiVersion="apps/v9")
    assert round_trip_problems(broken)
    # commands, probes, grace, references
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    with pytest.raises(pytest.fail.Exception):
        parse_serve(["MODEL", "--no-such-flag"])
    with pytest.raises(pytest.fail.Exception):
        parse_serve(["MODEL", "--port", "$(PORT)"])
    assert expand(["--host-id", "$(NOPE)"], container)[1] == ["NOPE"]
    swapped = dict(container, livenessProbe=container["readinessProbe"])
    assert probe_problems(swapped, 8000) and probe_problems(container, 9000)
    assert grace_problems({"terminationGracePeriodSeconds": 30}, container, 30)
    # the LeaderWorkerSet: a misspelled field, a wrong enum, a wrong type in its pod template
    _, _, lws = next(d for d in DOCS if d[2]["kind"] == "LeaderWorkerSet")
    assert lws_problems(lws) == []
    broken = json.loads(json.dumps(lws))
    broken["spec"]["leaderWorkerTemplate"]["sizes"] = 4
    broken["spec"]["startupPolicy"] = "Whenever"
    broken["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0][
        "args"].append(8000)
    assert len(lws_problems(broken)) == 3, lws_problems(broken)
    # the host-link key: in no Secret, or in an env value
    [leader, _] = pod_kinds(lws)
    worker_container = leader["spec"]["template"]["spec"]["containers"][0]
    unmounted = dict(worker_container, volumeMounts=worker_container["volumeMounts"][:1])
    assert key_problems(leader, unmounted)
    plain = dict(worker_container, env=[{"name": "JAXSERVE_HOST_LINK_KEY", "value": "x" * 64}])
    assert len(key_problems(leader, plain)) == 2
    file_docs = [d for n, _, d in DOCS if n == "single-host.yaml"]
    broken = json.loads(json.dumps(file_docs))
    for doc in broken:
        if doc["kind"] == "Service":
            doc["spec"]["selector"] = {"app.kubernetes.io/name": "elsewhere"}
        if doc["kind"] == "PersistentVolumeClaim":
            doc["metadata"]["name"] = "renamed"
    assert len(reference_problems(broken)) == 2
