"""Offline checks of the Kubernetes manifests in deploy/kubernetes (docs/kubernetes.md).

No cluster here: the manifests are checked for the mistakes that would break them on one. Every
YAML document parses (PyYAML, refusing duplicate keys) and every core object passes
``kubernetes-validate --strict`` for every Kubernetes version from 1.27 (the oldest the docs
support) to the newest kubernetes-validate knows. The PyTorchJob is a Kubeflow custom resource:
its pod template is validated as a core PodTemplate and its own fields against the training
operator's API. The agents' command line, with Kubernetes' ``$(VAR)`` expansion done as the
kubelet does it (and, for the PyTorchJob, the ``PET_*`` variables the operator adds), is
accepted by elastrun's own parser (and the script's flags by the script's); the etcd endpoints
name the etcd StatefulSet's members; the grace period outlasts ``--shutdown-timeout``; Services
select the pods they are for.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from elastrun.launcher.cli import parse

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "kubernetes"
MANIFESTS = sorted(DEPLOY.glob("*.yaml"))
AGENT_MANIFESTS = [
    "job.yaml",
    "job-gpu.yaml",
    "job-spares.yaml",
    "statefulset.yaml",
    "pytorchjob.yaml",
]
GPUS_PER_POD = 8  # what job-gpu.yaml asks for; this machine has none
OLDEST_K8S = (1, 27)  # docs/kubernetes.md: "Needs Kubernetes 1.27 or newer"

# Values the downward API would give, for the $(VAR) expansion.
FIELD_VALUES = {
    "metadata.name": "train-0",
    "metadata.namespace": "ml",
    "status.podIP": "10.1.2.3",
    "metadata.labels['batch.kubernetes.io/job-name']": "train",
    "metadata.labels['batch.kubernetes.io/controller-uid']": "0f6f1b2c-3d4e-4f50-9a6b-7c8d9e0f1a2b",
    "metadata.annotations['batch.kubernetes.io/job-completion-index']": "1",
    "metadata.labels['jobset.sigs.k8s.io/jobset-name']": "train-v2",
}


# ----------------------------------------------------------------- YAML and schemas


class _UniqueKeyLoader(yaml.SafeLoader):  # type: ignore[misc]
    """PyYAML's safe loader, refusing duplicate keys (PyYAML keeps the last one silently)."""

    def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return dict(super().construct_mapping(node, deep=deep))


def load_all(text: str) -> list[Any]:
    return [d for d in yaml.load_all(text, Loader=_UniqueKeyLoader) if d is not None]


def test_loader_refuses_duplicate_keys() -> None:
    assert load_all("a: 1\n---\nb: [x, 'y: z']\n") == [{"a": 1}, {"b": ["x", "y: z"]}]
    with pytest.raises(yaml.YAMLError, match="duplicate key 'a'"):
        load_all("a: 1\nb: 2\na: 3\n")


def k8s_versions() -> list[str]:
    """Every minor version kubernetes-validate has schemas for, from OLDEST_K8S on."""
    from kubernetes_validate.utils import all_versions

    minors = {tuple(int(x) for x in v.split(".")[:2]) for v in all_versions()}
    return [f"{a}.{b}.0" for a, b in sorted(minors) if (a, b) >= OLDEST_K8S]


def schema_errors(doc: dict[str, Any], version: str) -> str | None:
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        where = ".".join(str(p) for p in exc.path) or "(top)"
        return f"{doc['kind']}/{doc['metadata']['name']} on {version}: {where}: {exc.message}"
    return None


# ----------------------------------------------------------------- helpers


def manifest(name: str) -> list[dict[str, Any]]:
    docs = load_all((DEPLOY / name).read_text(encoding="utf-8"))
    assert all(isinstance(d, dict) for d in docs), name
    return docs


def one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [
        d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)
    ]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def container(pod_spec: dict[str, Any], name: str) -> dict[str, Any]:
    found: list[dict[str, Any]] = [c for c in pod_spec["containers"] if c["name"] == name]
    assert len(found) == 1, f"no container {name!r}"
    return found[0]


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: defined variables are replaced, $$ escapes, others stay."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, text)


def container_env(c: dict[str, Any], added: list[dict[str, Any]] | None = None) -> dict[str, str]:
    """The container's environment as the kubelet builds it, in order, with downward API
    values from FIELD_VALUES; ``added``: entries a controller appends after the container's own
    (as the training operator does with its PET_* variables)."""
    env: dict[str, str] = {}
    for item in [*c.get("env", []), *(added or [])]:
        if "value" in item:
            env[item["name"]] = expand(str(item["value"]), env)
        elif "secretKeyRef" in item["valueFrom"]:
            env[item["name"]] = "from-a-secret"
        else:
            path = item["valueFrom"]["fieldRef"]["fieldPath"]
            assert path in FIELD_VALUES, f"env {item['name']}: unexpected fieldPath {path!r}"
            env[item["name"]] = FIELD_VALUES[path]
    return env


def agent_argv(c: dict[str, Any], added: list[dict[str, Any]] | None = None) -> list[str]:
    env = container_env(c, added)
    words = [expand(str(w), env) for w in [*c["command"], *c.get("args", [])]]
    left = [w for w in words if "$(" in w]
    assert not left, f"undefined $(VAR) references: {left}"
    assert words[0] == "elastrun", words
    return words[1:]


WORKLOADS = {
    "job.yaml": "Job",
    "job-gpu.yaml": "Job",
    "job-spares.yaml": "Job",
    "statefulset.yaml": "StatefulSet",
    "pytorchjob.yaml": "PyTorchJob",
}
AGENT_CONTAINER = {
    "job.yaml": "elastrun",
    "job-gpu.yaml": "elastrun",
    "job-spares.yaml": "elastrun",
    "statefulset.yaml": "elastrun",
    "pytorchjob.yaml": "pytorch",
}


def pod_template(workload: dict[str, Any]) -> dict[str, Any]:
    spec = workload["spec"]
    template: dict[str, Any] = (
        spec["pytorchReplicaSpecs"]["Worker"]["template"]
        if workload["kind"] == "PyTorchJob"
        else spec["template"]
    )
    return template


def agent_pod_spec(name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    workload = one(manifest(name), WORKLOADS[name])
    return workload, pod_template(workload)["spec"]


def agent_container(name: str) -> dict[str, Any]:
    return container(agent_pod_spec(name)[1], AGENT_CONTAINER[name])


def operator_env(job: dict[str, Any]) -> list[dict[str, Any]]:
    """The variables the Kubeflow training operator (kubeflow.org/v1) appends to each container
    of an elastic PyTorchJob with Worker replicas only, from ``spec.elasticPolicy``."""
    policy = job["spec"]["elasticPolicy"]
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    host = policy.get("rdzvHost", f"{job['metadata']['name']}-worker-0")
    port = policy.get("rdzvPort", 23456)  # else the container's "pytorchjob-port"
    if "minReplicas" in policy or "maxReplicas" in policy:
        nnodes = f"{policy['minReplicas']}:{policy['maxReplicas']}"
    else:
        nnodes = str(worker["replicas"])
    env = {
        "PYTHONUNBUFFERED": "0",
        "PET_RDZV_ENDPOINT": f"{host}:{port}",
        "PET_RDZV_BACKEND": policy.get("rdzvBackend", "c10d"),
        "PET_NNODES": nnodes,
    }
    if "maxRestarts" in policy:
        env["PET_MAX_RESTARTS"] = str(policy["maxRestarts"])
    if "nProcPerNode" in policy:
        env["PET_NPROC_PER_NODE"] = str(policy["nProcPerNode"])
    if "rdzvId" in policy:
        env["PET_RDZV_ID"] = policy["rdzvId"]
    if policy.get("rdzvConf"):
        env["PET_RDZV_CONF"] = ",".join(f"{c['key']}={c['value']}" for c in policy["rdzvConf"])
    if policy.get("standalone"):
        env["PET_STANDALONE"] = ""
    return [{"name": k, "value": v} for k, v in env.items()]


def agent_setup(name: str) -> tuple[list[str], dict[str, str]]:
    """(the agent's argv after expansion, the PET_* variables it runs with)."""
    c = agent_container(name)
    added = operator_env(agent_pod_spec(name)[0]) if name == "pytorchjob.yaml" else []
    env = container_env(c, added)
    return agent_argv(c, added), {k: v for k, v in env.items() if k.startswith("PET_")}


def etcd_statefulset() -> dict[str, Any]:
    return one(manifest("etcd.yaml"), "StatefulSet", "etcd")


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The parser reads PET_* and torch's variables: none may leak in from the test run."""
    for key in list(os.environ):
        if key.startswith(("PET_", "TORCH_ELASTIC")):
            monkeypatch.delenv(key)
    monkeypatch.delenv("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", raising=False)


# ----------------------------------------------------------------- every manifest


def test_manifests_exist() -> None:
    names = {p.name for p in MANIFESTS}
    assert {
        "etcd.yaml",
        "job.yaml",
        "job-gpu.yaml",
        "job-spares.yaml",
        "statefulset.yaml",
        "pytorchjob.yaml",
    } <= names


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_every_document_parses_and_is_a_k8s_object(path: Path) -> None:
    docs = load_all(path.read_text(encoding="utf-8"))
    assert docs
    for doc in docs:
        assert isinstance(doc, dict)
        assert doc.get("apiVersion") and doc.get("kind"), doc
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", doc["metadata"]["name"])


def test_schema_versions_span_the_supported_range() -> None:
    versions = k8s_versions()
    assert versions[0] == "1.27.0"
    assert versions[-1] == f"{kubernetes_validate.latest_version().rsplit('.', 1)[0]}.0"
    assert len(versions) >= 8, versions  # 1.27 .. 1.34 at least: the failing range seen before


def replicated_jobs(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """A JobSet's (or a Trainer runtime's JobSet template's) replicated jobs."""
    spec = doc["spec"] if doc["kind"] == "JobSet" else doc["spec"]["template"]["spec"]
    jobs: list[dict[str, Any]] = spec["replicatedJobs"]
    return jobs


def core_parts(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """What of ``doc`` core schemas check: a core object itself; a PyTorchJob's pod template
    as a PodTemplate; each replicated job of a JobSet or a ClusterTrainingRuntime as a Job; a
    TrainJob has none (its fields: test_trainjob_uses_the_runtime)."""
    name = doc["metadata"]["name"]
    if doc["apiVersion"].startswith("kubeflow.org/"):
        template = pod_template(doc)
        return [
            {
                "apiVersion": "v1",
                "kind": "PodTemplate",
                "metadata": {"name": name},
                "template": template,
            }
        ]
    if doc["kind"] in ("JobSet", "ClusterTrainingRuntime"):
        return [
            {
                "apiVersion": "batch/v1",
                "kind": "Job",
                "metadata": {"name": f"{name}-{rj['name']}", **rj["template"].get("metadata", {})},
                "spec": rj["template"]["spec"],
            }
            for rj in replicated_jobs(doc)
        ]
    if doc["kind"] == "TrainJob":
        return []
    return [doc]


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_core_objects_pass_strict_schema_validation(path: Path) -> None:
    """kubernetes-validate --strict, for each version from 1.27 to the newest it knows. Custom
    resources have no core schema: their pod or job templates are checked instead (core_parts)."""
    errors = []
    for found in manifest(path.name):
        if found["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # the Prometheus Operator's: checked by its own test below
        for doc in core_parts(found):
            for version in k8s_versions():
                err = schema_errors(doc, version)
                if err:
                    errors.append(err)
    assert not errors, "\n".join(errors)


def test_strict_validation_catches_what_it_must() -> None:
    """The check can fail: an unknown field, a wrong type, the 1.27 and 1.29-1.34 pitfalls."""
    job = one(manifest("job.yaml"), "Job")
    latest = k8s_versions()[-1]
    assert schema_errors(job, "1.27.0") is None
    bad = yaml.safe_load(yaml.safe_dump(job))
    bad["spec"]["template"]["spec"]["containers"][0]["enviroment"] = []
    assert "enviroment" in (schema_errors(bad, latest) or "")
    bad = yaml.safe_load(yaml.safe_dump(job))
    bad["spec"]["parallelism"] = "three"
    assert "parallelism" in (schema_errors(bad, latest) or "")
    rules = yaml.safe_load(yaml.safe_dump(job))["spec"]["podFailurePolicy"]["rules"]
    no_conditions = yaml.safe_load(yaml.safe_dump(job))
    no_conditions["spec"]["podFailurePolicy"]["rules"][0] = {
        k: v for k, v in rules[0].items() if k != "onPodConditions"
    }
    assert "onPodConditions" in (schema_errors(no_conditions, "1.27.0") or "")
    no_status = yaml.safe_load(yaml.safe_dump(job))
    del no_status["spec"]["podFailurePolicy"]["rules"][1]["onPodConditions"][0]["status"]
    assert "status" in (schema_errors(no_status, "1.30.0") or "")


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_services_and_workloads_select_their_pods(path: Path) -> None:
    docs = manifest(path.name)
    pods = [
        pod_template(d)["metadata"]["labels"]
        for d in docs
        if d["kind"] in ("Job", "StatefulSet", "PyTorchJob")
    ]
    for doc in docs:
        selector = doc["spec"].get("selector")
        if doc["kind"] == "Service":
            assert any(selector.items() <= labels.items() for labels in pods), doc
        if doc["kind"] in ("StatefulSet", "PodDisruptionBudget"):
            wanted = selector["matchLabels"]
            assert any(wanted.items() <= labels.items() for labels in pods), doc
        if doc["kind"] == "StatefulSet":
            service = one(docs, "Service", doc["spec"]["serviceName"])
            assert service["spec"]["clusterIP"] == "None"
            assert doc["spec"]["podManagementPolicy"] == "Parallel"


# ----------------------------------------------------------------- etcd


def test_etcd_cluster_flags_name_its_own_members() -> None:
    sts = etcd_statefulset()
    replicas = sts["spec"]["replicas"]
    assert replicas == 3
    service = sts["spec"]["serviceName"]
    headless = one(manifest("etcd.yaml"), "Service", service)
    assert headless["spec"]["clusterIP"] == "None"
    # members resolve each other before any is ready (none is ready without a quorum)
    assert headless["spec"]["publishNotReadyAddresses"] is True
    assert {p["port"] for p in headless["spec"]["ports"]} == {2379, 2380}
    client = one(manifest("etcd.yaml"), "Service", "etcd-client")
    assert [p["port"] for p in client["spec"]["ports"]] == [2379]

    c = container(sts["spec"]["template"]["spec"], "etcd")
    assert re.fullmatch(r"[\w./-]+:v3\.5\.\d+", c["image"]), c["image"]
    env = container_env(c)
    assert env["POD_NAME"] == FIELD_VALUES["metadata.name"]
    flags = dict(w.split("=", 1) for w in [expand(a, env) for a in c["args"]])
    name = sts["metadata"]["name"]
    members = [f"{name}-{i}" for i in range(replicas)]
    assert flags["--initial-cluster"] == ",".join(f"{m}=http://{m}.{service}:2380" for m in members)
    me = FIELD_VALUES["metadata.name"]
    assert flags["--name"] == me
    assert flags["--initial-advertise-peer-urls"] == f"http://{me}.{service}:2380"
    assert flags["--advertise-client-urls"] == f"http://{me}.{service}:2379"
    assert flags["--initial-cluster-state"] == "new"
    data = flags["--data-dir"]
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    claims = {t["metadata"]["name"] for t in sts["spec"]["volumeClaimTemplates"]}
    assert any(data.startswith(path) and vol in claims for path, vol in mounts.items()), (
        "etcd's data dir must be on its PersistentVolumeClaim"
    )
    assert "livenessProbe" not in c, "a liveness probe on /health restarts members on quorum loss"


# ----------------------------------------------------------------- the agents


@pytest.mark.parametrize("name", AGENT_MANIFESTS)
def test_agent_command_line_parses_with_elastrun(
    name: str, clean_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    workload, pod = agent_pod_spec(name)
    c = agent_container(name)
    argv, pet = agent_setup(name)
    for key, value in pet.items():
        monkeypatch.setenv(key, value)
    # --nproc-per-node=gpu counts the GPUs the pod is given: as a GPU pod would see them.
    monkeypatch.setattr("elastrun.launcher.flag_grammar.count_gpus", lambda: GPUS_PER_POD)
    # The image's WORKDIR holds examples/ as the repository root does: resolve the script there.
    assert c["workingDir"] == "/app"
    monkeypatch.chdir(ROOT)
    plan, cmd = parse(argv)

    assert plan.backend == "etcd"
    assert not plan.standalone
    assert plan.local_addr == FIELD_VALUES["status.podIP"]
    assert plan.rendezvous.max_restarts >= 1
    assert plan.conf.key_prefix == f"/elastrun-k8s/{FIELD_VALUES['metadata.namespace']}"
    assert plan.rendezvous.lease_ttl > 0
    if name in ("job.yaml", "job-gpu.yaml", "job-spares.yaml"):
        label = FIELD_VALUES["metadata.labels['batch.kubernetes.io/controller-uid']"]
        assert plan.run_id.endswith(label), "the run id must be unique per Job"
    else:
        assert plan.run_id not in ("", "none")

    # N pods within the elastic range
    spec = workload["spec"]
    pods = {
        "job.yaml": lambda: spec["parallelism"],
        "job-gpu.yaml": lambda: spec["parallelism"],
        "job-spares.yaml": lambda: spec["parallelism"],
        "statefulset.yaml": lambda: spec["replicas"],
        "pytorchjob.yaml": lambda: spec["pytorchReplicaSpecs"]["Worker"]["replicas"],
    }[name]()
    assert plan.rendezvous.min_nodes <= pods <= plan.rendezvous.max_nodes
    assert plan.rendezvous.min_nodes < plan.rendezvous.max_nodes, "elastic: MIN < MAX"
    if name == "job-spares.yaml":  # N+S pods: at least one waits as a hot spare
        assert plan.rendezvous.node_unit > 1
        assert pods > plan.rendezvous.sizes().fit(pods - 1) == plan.rendezvous.sizes().largest

    # the etcd endpoints are the etcd StatefulSet's members, through its headless Service
    sts = etcd_statefulset()
    members = [
        (f"{sts['metadata']['name']}-{i}.{sts['spec']['serviceName']}", 2379)
        for i in range(sts["spec"]["replicas"])
    ]
    assert list(plan.endpoints) == members

    # terminationGracePeriodSeconds outlasts the workers' SIGTERM -> SIGKILL grace
    grace = pod["terminationGracePeriodSeconds"]
    assert grace > plan.workers.shutdown_timeout + 10, (grace, plan.workers.shutdown_timeout)

    # the checkpoint dir is the emptyDir volume
    assert cmd.script == "examples/train.py"
    script_args = list(cmd.args)
    ckpt = next(a.split("=", 1)[1] for a in script_args if a.startswith("--checkpoint-dir="))
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert ckpt in mounts
    assert "emptyDir" in volumes[mounts[ckpt]]


@pytest.mark.parametrize("name", AGENT_MANIFESTS)
def test_script_arguments_parse_with_the_example(name: str, clean_env: None) -> None:
    pytest.importorskip("torch")
    argv, _ = agent_setup(name)
    script_at = argv.index("examples/train.py")
    spec = importlib.util.spec_from_file_location("k8s_example_train", ROOT / "examples/train.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    ns = module.parse_args(argv[script_at + 1 :])
    assert ns.checkpoint_dir == "/ckpt"


def test_the_gpu_job_runs_one_worker_per_gpu_on_its_gpu_over_nccl(
    clean_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, pod = agent_pod_spec("job-gpu.yaml")
    c = agent_container("job-gpu.yaml")
    limits, requests = c["resources"]["limits"], c["resources"]["requests"]
    assert limits["nvidia.com/gpu"] == requests["nvidia.com/gpu"] == GPUS_PER_POD
    argv, _ = agent_setup("job-gpu.yaml")
    monkeypatch.setattr("elastrun.launcher.flag_grammar.count_gpus", lambda: GPUS_PER_POD)
    monkeypatch.chdir(ROOT)
    plan, cmd = parse(argv)
    assert plan.workers.nproc == GPUS_PER_POD  # one worker per GPU the pod is given
    assert "--device=cuda" in cmd.args  # each on its local rank's GPU, NCCL by default
    env = container_env(c)
    assert env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == "eth0"
    # Shared memory for NCCL: a memory-backed /dev/shm well above the 64 MiB default.
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    shm = {v["name"]: v for v in pod["volumes"]}[mounts["/dev/shm"]]["emptyDir"]
    assert shm["medium"] == "Memory" and shm["sizeLimit"].endswith("Gi")
    assert int(shm["sizeLimit"][:-2]) >= 8
    assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
    # RDMA may pin its buffers beyond the container's memlock limit.
    assert "IPC_LOCK" in c["securityContext"]["capabilities"]["add"]
    # The same job as job.yaml otherwise: the same rendezvous flags, the same training.
    cpu_args = agent_container("job.yaml")["args"]
    gpu_args = [a for a in c["args"] if a not in ("--nproc-per-node=gpu", "--device=cuda")]
    assert gpu_args == [a for a in cpu_args if a != "--nproc-per-node=2"]


# ----------------------------------------------------------------- the PyTorchJob

# The training operator's kubeflow.org/v1 PyTorchJob API: the fields it knows.
PTJ_SPEC = {"runPolicy", "elasticPolicy", "pytorchReplicaSpecs", "nprocPerNode"}
PTJ_ELASTIC = {
    "minReplicas", "maxReplicas", "rdzvBackend", "rdzvPort", "rdzvHost", "rdzvId", "rdzvConf",
    "standalone", "nProcPerNode", "maxRestarts", "metrics",
}  # fmt: skip
PTJ_RUN_POLICY = {
    "cleanPodPolicy", "ttlSecondsAfterFinished", "activeDeadlineSeconds", "backoffLimit",
    "schedulingPolicy", "suspend", "managedBy",
}  # fmt: skip
PTJ_REPLICA = {"replicas", "template", "restartPolicy"}


def test_pytorchjob_uses_only_fields_the_operator_knows() -> None:
    job = one(manifest("pytorchjob.yaml"), "PyTorchJob")
    assert job["apiVersion"] == "kubeflow.org/v1"
    spec = job["spec"]
    assert set(spec) <= PTJ_SPEC, set(spec) - PTJ_SPEC
    policy = spec["elasticPolicy"]
    assert set(policy) <= PTJ_ELASTIC, set(policy) - PTJ_ELASTIC
    assert set(spec.get("runPolicy", {})) <= PTJ_RUN_POLICY
    assert policy["rdzvBackend"] in ("c10d", "etcd", "etcd-v2")
    assert policy["rdzvBackend"] == "etcd"
    assert all(set(c) == {"key", "value"} for c in policy["rdzvConf"])
    assert all(isinstance(c["value"], str) for c in policy["rdzvConf"])
    assert set(spec["pytorchReplicaSpecs"]) == {"Worker"}, "elastic: workers only, no Master"
    worker = spec["pytorchReplicaSpecs"]["Worker"]
    assert set(worker) <= PTJ_REPLICA
    assert worker["restartPolicy"] in ("Always", "OnFailure", "Never", "ExitCode")
    assert policy["minReplicas"] <= worker["replicas"] <= policy["maxReplicas"]
    # the operator looks for its container by this name
    assert [c["name"] for c in worker["template"]["spec"]["containers"]] == ["pytorch"]


def test_pytorchjob_rendezvous_comes_from_the_operators_pet_variables(
    clean_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """elastrun takes the backend, nnodes, run id, restarts and rdzv conf from PET_* alone; the
    command line only adds the member list (a flag wins over its PET_ variable)."""
    job = one(manifest("pytorchjob.yaml"), "PyTorchJob")
    policy = job["spec"]["elasticPolicy"]
    argv, pet = agent_setup("pytorchjob.yaml")
    assert pet["PET_NNODES"] == f"{policy['minReplicas']}:{policy['maxReplicas']}"
    assert pet["PET_RDZV_CONF"] == "lease_ttl=10,key_prefix=/elastrun-k8s/ml"  # expanded
    flags = {a.split("=", 1)[0] for a in argv[: argv.index("examples/train.py")]}
    for taken_from_env in (
        "--nnodes", "--rdzv-backend", "--rdzv-id", "--rdzv-conf", "--max-restarts",
    ):  # fmt: skip
        assert taken_from_env not in flags
    for key, value in pet.items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(ROOT)
    plan, _ = parse(argv)
    assert (plan.rendezvous.min_nodes, plan.rendezvous.max_nodes) == (2, 4)
    assert plan.run_id == policy["rdzvId"]
    assert plan.rendezvous.max_restarts == policy["maxRestarts"]
    assert plan.backend == "etcd"
    # Without the flag, PET_RDZV_ENDPOINT (rdzvHost:rdzvPort) is the endpoint.
    at = next(i for i, a in enumerate(argv) if a.startswith("--rdzv-endpoint="))
    plan, _ = parse(argv[:at] + argv[at + 1 :])
    assert list(plan.endpoints) == [(policy["rdzvHost"], policy["rdzvPort"])]


def test_agent_pods_reach_each_other_and_etcd() -> None:
    docs = manifest("job.yaml")
    job = one(docs, "Job", "train")
    pod = job["spec"]["template"]["spec"]
    assert one(docs, "Service", pod["subdomain"])["spec"]["clusterIP"] == "None"
    # Both manifests run the same agent command line (one of them must not drift).
    job_args = agent_container("job.yaml")["args"]
    assert agent_container("statefulset.yaml")["args"] == job_args
    # The PyTorchJob trains the same way (its rendezvous flags come from PET_* instead).
    script_at = job_args.index("examples/train.py")
    ptj_args = agent_container("pytorchjob.yaml")["args"]
    assert ptj_args[ptj_args.index("examples/train.py") :] == job_args[script_at:]


def test_job_is_indexed_and_elastic() -> None:
    job = one(manifest("job.yaml"), "Job", "train")
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    # resizing an Indexed Job patches both together; they must start equal
    assert spec["parallelism"] == spec["completions"]
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never", "podFailurePolicy requires restartPolicy Never"
    assert spec["backoffLimit"] >= spec["parallelism"], "room to replace each pod once"
    rules = spec["podFailurePolicy"]["rules"]
    fail = [r for r in rules if r["action"] == "FailJob"]
    assert fail and fail[0]["onExitCodes"]["values"] == [2], "exit 2 = configuration error"
    assert fail[0]["onExitCodes"]["containerName"] in {c["name"] for c in pod["containers"]}
    assert any(
        r["action"] == "Ignore" and r["onPodConditions"][0]["type"] == "DisruptionTarget"
        for r in rules
    )


# ----------------------------------------------------------------- image and docs


def test_dockerfile_matches_the_project() -> None:
    text = (DEPLOY / "Dockerfile").read_text(encoding="utf-8")
    assert re.search(r"^FROM python:3\.11-slim$", text, re.M)
    pin = re.search(r'"torch==([\d.]+)"', (ROOT / "pyproject.toml").read_text())
    assert pin is not None
    assert f"ARG TORCH_VERSION={pin.group(1)}" in text, "the image's torch is the project's"
    assert 'pip install "/src[etcd]"' in text
    assert re.search(r"^WORKDIR /app$", text, re.M)
    assert re.search(r"^COPY examples /app/examples$", text, re.M)
    # It says how to put your own script in the image, and where the manifests name it.
    own = re.search(r"^# Your own job: .*\n(?:#.*\n)*", text, re.M)
    assert own, "the Dockerfile does not say how to add your own script"
    assert "COPY" in own.group(0) and "args" in own.group(0), own.group(0)
    copied = {w for line in text.splitlines() if line.startswith("COPY ") for w in line.split()}
    # What pip needs to build: the project's files and its description (pyproject's readme).
    readme = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["readme"]["file"]
    for needed in ("pyproject.toml", "LICENSE", "src", readme):
        assert needed in copied, needed


def test_the_documented_sed_commands_leave_no_placeholder_image(tmp_path: Path) -> None:
    """Every manifest that runs our image names it REGISTRY/...; after the
    sed commands docs/kubernetes.md gives, run on a copy, none is left."""
    text = (ROOT / "docs" / "kubernetes.md").read_text(encoding="utf-8")
    commands = re.findall(r"^sed -i '([^']+)' \\\n\s+(\S+)", text, re.M)
    assert len(commands) >= 2, commands  # the CPU image and the CUDA one
    copies = tmp_path / "deploy" / "kubernetes"
    copies.mkdir(parents=True)
    for path in DEPLOY.glob("*.yaml"):
        (copies / path.name).write_text(path.read_text(encoding="utf-8"), encoding="utf-8")
    placeholders = [p.name for p in copies.glob("*.yaml") if "image: REGISTRY/" in p.read_text()]
    assert len(placeholders) >= 3, placeholders
    for script, files in commands:
        targets = sorted(tmp_path.glob(files))
        assert targets, files
        done = subprocess.run(["sed", "-i", script, *map(str, targets)], check=False)
        assert done.returncode == 0, script
    for path in copies.glob("*.yaml"):
        images = re.findall(r"^\s*image:\s*(\S+)", path.read_text(), re.M)
        assert not [i for i in images if "REGISTRY" in i], (path.name, images)


def test_docs_name_files_that_exist_and_commands_that_parse(clean_env: None) -> None:
    text = (ROOT / "docs" / "kubernetes.md").read_text(encoding="utf-8")
    for rel in set(re.findall(r"deploy/kubernetes/[\w.-]+", text)):
        assert (ROOT / rel).exists(), rel
    assert "docs/kubernetes.md" in (ROOT / "README.md").read_text(encoding="utf-8")
    # every `elastrun status` shown uses the job's etcd endpoints and key prefix
    _, pod = agent_pod_spec("job.yaml")
    env = {i["name"]: i.get("value", "") for i in container(pod, "elastrun")["env"]}
    shown = [line for line in text.splitlines() if "elastrun status" in line]
    assert shown
    for line in shown:
        if "--rdzv-endpoint" not in line:
            continue
        words = shlex.split(line.split("elastrun status", 1)[1].rstrip("\\ '\""))
        flags = dict(w.split("=", 1) for w in words if w.startswith("--") and "=" in w)
        if "--rdzv-backend" not in flags:  # c10d: the c10d StatefulSet's candidate list
            assert flags["--rdzv-endpoint"] == "$RDZV_ENDPOINT", line
            continue
        assert flags["--rdzv-backend"] == "etcd", line
        endpoint = flags["--rdzv-endpoint"]
        assert endpoint in (env["RDZV_ENDPOINT"], "127.0.0.1:2379", "$RDZV_ENDPOINT"), line


# ----------------------------------------------------------------- the c10d StatefulSet


def test_the_c10d_statefulset_names_its_first_three_pods_as_candidate_hosts(
    clean_env: None,
) -> None:
    """Without etcd: every pod gives the same list (pods 0-2 by their names in the headless
    Service, which publishes them before they are ready) and its own name as --local-addr, so
    that pods 0-2 are candidates 0-2 and a 4th pod is none."""
    from elastrun.launcher.hosting import my_candidate

    docs = manifest("statefulset-c10d.yaml")
    sts, service = one(docs, "StatefulSet"), one(docs, "Service")
    assert sts["spec"]["serviceName"] == service["metadata"]["name"] == "train-c10d"
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"]
    assert sts["spec"]["replicas"] >= 3
    c = container(pod_template(sts)["spec"], "elastrun")
    names = [item["name"] for item in c["env"]]
    assert "ELASTRUN_STORE_TOKEN" in names  # from a Secret: never on a command line
    lists = set()
    for pod in range(4):
        env = {item["name"]: item.get("value", "") for item in c["env"]}
        env["POD_NAME"] = f"train-c10d-{pod}"
        words = [expand(str(w), env) for w in c["args"]]
        plan, _ = parse(words)
        assert plan.failover and plan.rendezvous.lease_ttl >= 3
        lists.add(plan.endpoints)
        expected = pod if pod < 3 else None
        assert my_candidate(plan.endpoints, plan.local_addr) == expected
    assert len(lists) == 1  # the same list on every pod
    assert [e.host for e in lists.pop()] == [f"train-c10d-{i}.train-c10d" for i in range(3)]


# ----------------------------------------------------------------- JobSet and Kubeflow Trainer v2


def jobset_pod(doc: dict[str, Any]) -> dict[str, Any]:
    jobs = replicated_jobs(doc)
    assert len(jobs) == 1, "one replicated job of agents"
    pod: dict[str, Any] = jobs[0]["template"]["spec"]["template"]
    return pod


def test_the_jobset_names_its_pods_as_candidate_hosts_with_a_spare(clean_env: None) -> None:
    """Every pod gives the same candidate list (the pods' JobSet host names) and its own name
    as --local-addr; 3 pods train on worlds of 2, the 3rd a spare."""
    from elastrun.launcher.hosting import my_candidate

    js = one(manifest("jobset.yaml"), "JobSet")
    net, rj = js["spec"]["network"], replicated_jobs(js)[0]
    assert net["enableDNSHostnames"] and net["publishNotReadyAddresses"]
    job = rj["template"]["spec"]
    assert job["completionMode"] == "Indexed" and job["parallelism"] == job["completions"] == 3
    c = container(jobset_pod(js)["spec"], "elastrun")
    assert "ELASTRUN_STORE_TOKEN" in [item["name"] for item in c["env"]]
    lists = set()
    for index in range(job["parallelism"]):
        env = container_env(c)
        env["POD_INDEX"] = str(index)
        words = [expand(str(w), env) for w in c["args"]]
        plan, _ = parse(words)
        assert plan.failover and plan.rendezvous.lease_ttl >= 3
        assert (plan.rendezvous.min_nodes, plan.rendezvous.max_nodes) == (2, 3)
        assert plan.rendezvous.node_unit == 2  # worlds of 2: the 3rd pod waits as a spare
        lists.add(plan.endpoints)
        # JobSet's host name of the pod: <jobset>-<replicated job>-<job index>-<pod index>
        own = f"{js['metadata']['name']}-{rj['name']}-0-{index}.{net['subdomain']}"
        assert plan.local_addr == own
        assert my_candidate(plan.endpoints, plan.local_addr) == index
    assert len(lists) == 1


def trainer_env(runtime: dict[str, Any], trainjob: dict[str, Any]) -> list[dict[str, Any]]:
    """The variables the Trainer's torch plugin adds to the container named "node"."""
    nodes = trainjob["spec"]["trainer"].get("numNodes", runtime["spec"]["mlPolicy"]["numNodes"])
    torch = runtime["spec"]["mlPolicy"]["torch"]
    nproc = trainjob["spec"]["trainer"].get("numProcPerNode", torch["numProcPerNode"])
    name = trainjob["metadata"]["name"]
    env = {
        "PET_NNODES": str(nodes),
        "PET_NPROC_PER_NODE": str(nproc),
        "PET_NODE_RANK": "1",
        "PET_MASTER_ADDR": f"{name}-node-0-0.{name}",
        "PET_MASTER_PORT": "29400",
    }
    return [{"name": k, "value": v} for k, v in env.items()]


def test_trainjob_uses_the_runtime_and_runs_elastic(
    clean_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    docs = manifest("trainjob.yaml")
    runtime, trainjob = one(docs, "ClusterTrainingRuntime"), one(docs, "TrainJob")
    assert runtime["apiVersion"] == trainjob["apiVersion"] == "trainer.kubeflow.org/v1alpha1"
    ref = trainjob["spec"]["runtimeRef"]
    assert (ref["kind"], ref["name"]) == ("ClusterTrainingRuntime", runtime["metadata"]["name"])
    assert runtime["metadata"]["labels"]["trainer.kubeflow.org/framework"] == "torch"
    rj = replicated_jobs(runtime)
    assert [r["name"] for r in rj] == ["node"]  # the trainer's step, as the torch plugin finds it
    assert (
        rj[0]["template"]["metadata"]["labels"]["trainer.kubeflow.org/trainjob-ancestor-step"]
        == "trainer"
    )
    pod = jobset_pod(runtime)["spec"]
    assert [c["name"] for c in pod["containers"]] == ["node"]
    c = container(pod, "node")
    added = trainer_env(runtime, trainjob)
    argv = agent_argv(c, added)
    env = container_env(c, added)
    for key, value in env.items():
        if key.startswith("PET_"):
            monkeypatch.setenv(key, value)
    monkeypatch.chdir(ROOT)
    plan, _ = parse(argv)
    # elastic: the agents' --nnodes wins over PET_NNODES (numNodes pods start)
    nodes = trainjob["spec"]["trainer"]["numNodes"]
    assert plan.rendezvous.min_nodes < nodes <= plan.rendezvous.max_nodes
    assert plan.backend == "etcd" and plan.workers.nproc == 2
    assert plan.run_id == "train-v2"  # the TrainJob's (JobSet's) name
    endpoints = [f"{e.host}:{e.port}" for e in plan.endpoints]
    sts = etcd_statefulset()
    assert all(e.startswith(f"{sts['metadata']['name']}-") for e in endpoints), endpoints


LIVENESS_MANIFESTS = [*AGENT_MANIFESTS, "statefulset-c10d.yaml", "jobset.yaml", "trainjob.yaml"]


def agent_containers_of(name: str) -> list[dict[str, Any]]:
    found = []
    for doc in manifest(name):
        if doc["kind"] in ("JobSet", "ClusterTrainingRuntime"):
            pods = [jobset_pod(doc)]
        elif doc["kind"] in ("Job", "StatefulSet", "PyTorchJob"):
            pods = [pod_template(doc)]
        else:
            continue
        for pod in pods:
            found += [c for c in pod["spec"]["containers"] if c.get("command") == ["elastrun"]]
    assert found, name
    return found


@pytest.mark.parametrize("name", LIVENESS_MANIFESTS)
def test_every_agent_has_a_liveness_probe_on_its_health_check_port(name: str) -> None:
    """The probe asks the agent's health check (TORCHELASTIC_HEALTH_CHECK_PORT), served on an
    address the kubelet reaches (not loopback), on the path it answers."""
    from elastrun.agent.health_check import HOST_ENV, PATH, PORT_ENV, hosts_from, port_from

    for c in agent_containers_of(name):
        env = container_env(c)
        port, problem = port_from(env.get(PORT_ENV))
        assert port is not None and problem is None, (name, env.get(PORT_ENV))
        hosts = hosts_from(env.get(HOST_ENV))
        assert hosts and not {"127.0.0.1", "::1", "localhost"} & set(hosts), (name, hosts)
        probe = c["livenessProbe"]["httpGet"]
        assert (probe["port"], probe["path"]) == (port, PATH), name
        grace = c["livenessProbe"]["periodSeconds"] * c["livenessProbe"]["failureThreshold"]
        assert grace >= 30, "a loaded agent is not killed for one slow answer"


# ----------------------------------------------------------------- metrics

# The Prometheus Operator's monitoring.coreos.com/v1 PodMonitor: the fields used here.
PODMONITOR_SPEC = {"selector", "podMetricsEndpoints", "namespaceSelector", "jobLabel"}
PODMONITOR_ENDPOINT = {"port", "path", "interval", "scrapeTimeout", "scheme", "relabelings"}


def test_the_podmonitor_scrapes_the_metrics_port_the_agents_serve(
    clean_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monitor = one(manifest("podmonitor.yaml"), "PodMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(monitor["spec"]) <= PODMONITOR_SPEC
    endpoints = monitor["spec"]["podMetricsEndpoints"]
    assert all(set(e) <= PODMONITOR_ENDPOINT for e in endpoints)
    labels = pod_template(one(manifest("job.yaml"), "Job"))["metadata"]["labels"]
    wanted = monitor["spec"]["selector"]["matchLabels"]
    assert wanted.items() <= labels.items(), (wanted, labels)
    c = agent_container("job.yaml")
    ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
    for e in endpoints:
        assert e["path"] == "/metrics" and e["port"] in ports, (e, ports)
    # The agent serves that port on the pod's address (PET_METRICS_PORT: the flag's
    # variable, as elastrun's parser reads it).
    monkeypatch.setenv("PET_METRICS_PORT", container_env(c)["PET_METRICS_PORT"])
    monkeypatch.chdir(ROOT)  # the image's WORKDIR holds examples/ as the repository does
    plan, _ = parse(agent_argv(c))
    served = plan.workers.metrics
    assert served.port == ports["metrics"] and served.hosts == (FIELD_VALUES["status.podIP"],)


def test_the_grafana_dashboard_reads_series_the_agents_serve() -> None:
    import json

    from elastrun.agent.metrics import Metrics
    from elastrun.goodput import Goodput

    dash = json.loads((ROOT / "deploy" / "grafana" / "elastrun.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert exprs and len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    m = Metrics(round=0, world_size=1, members=1, spares=0, group_rank=0, store_term=1)
    m.goodput = lambda: Goodput({"training": 1.0})
    m.step_time = lambda: 0.1
    served = {line.split(" ")[2] for line in m.render().decode().splitlines() if "# TYPE" in line}
    series = set()
    for name in re.findall(r"\belastrun_[a-z_]+", " ".join(exprs)):
        series.add(re.sub(r"_(bucket|sum|count)$", "", name) if "recovery" in name else name)
    assert series and series <= served, series - served
