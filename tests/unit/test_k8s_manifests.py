"""Offline checks of the Kubernetes manifests in deploy/kubernetes (docs/kubernetes.md).

No cluster here: the manifests are checked for the mistakes that would break them on one. Every
YAML document parses; the agents' command line, with Kubernetes' ``$(VAR)`` expansion done as
the kubelet does it, is accepted by elastrun's own parser (and the script's flags by the
script's); the etcd endpoints name the etcd StatefulSet's members; the grace period outlasts
``--shutdown-timeout``; Services select the pods they are for.

PyYAML is not a dependency of the project, so the manifests are read with a small parser of
the YAML subset they are written in (block mappings and sequences, plain and quoted scalars,
flow collections of scalars). It refuses anything else, duplicate keys, tabs and YAML 1.1's
ambiguous booleans (``yes``/``no``/``on``/``off``). When PyYAML is installed its reading is
compared with ours.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
from pathlib import Path
from typing import Any

import pytest

from elastrun.launcher.cli import parse

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "kubernetes"
MANIFESTS = sorted(DEPLOY.glob("*.yaml"))
AGENT_MANIFESTS = ["job.yaml", "statefulset.yaml"]

# Values the downward API would give, for the $(VAR) expansion.
FIELD_VALUES = {
    "metadata.name": "train-0",
    "metadata.namespace": "ml",
    "status.podIP": "10.1.2.3",
    "metadata.labels['batch.kubernetes.io/job-name']": "train",
    "metadata.labels['batch.kubernetes.io/controller-uid']": "0f6f1b2c-3d4e-4f50-9a6b-7c8d9e0f1a2b",
}


# ----------------------------------------------------------------- YAML subset


class YamlSubsetError(ValueError):
    pass


_AMBIGUOUS = {"yes", "no", "on", "off", "y", "n"}
_INT = re.compile(r"^[-+]?(0|[1-9][0-9]*)$")
_KEY = re.compile(r"""^("[^"]*"|'[^']*'|[^\s'"#\-\[\]{}][^:#]*?|-[^\s:][^:#]*?):(?:\s+(.*))?$""")


def _strip_comment(text: str) -> str:
    quote = ""
    for i, ch in enumerate(text):
        if quote:
            if ch == quote:
                quote = ""
        elif ch in "\"'" and (i == 0 or text[i - 1] in " :[{,-"):
            quote = ch
        elif ch == "#" and (i == 0 or text[i - 1] in " \t"):
            return text[:i].rstrip()
    return text.rstrip()


def _split_flow(body: str, where: str) -> list[str]:
    items, depth, quote, start = [], 0, "", 0
    for i, ch in enumerate(body):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        elif ch == "," and depth == 0:
            items.append(body[start:i].strip())
            start = i + 1
    last = body[start:].strip()
    if last:
        items.append(last)
    if any(not item for item in items):
        raise YamlSubsetError(f"{where}: empty item in flow collection {body!r}")
    return items


def _scalar(text: str, where: str) -> Any:
    text = text.strip()
    if text.startswith('"'):
        if not text.endswith('"') or len(text) < 2:
            raise YamlSubsetError(f"{where}: unterminated string {text!r}")
        return json.loads(text)  # the subset's double-quoted escapes are JSON's
    if text.startswith("'"):
        if not text.endswith("'") or len(text) < 2:
            raise YamlSubsetError(f"{where}: unterminated string {text!r}")
        return text[1:-1].replace("''", "'")
    if text.startswith("["):
        if not text.endswith("]"):
            raise YamlSubsetError(f"{where}: unterminated flow sequence {text!r}")
        return [_scalar(item, where) for item in _split_flow(text[1:-1], where)]
    if text.startswith("{"):
        if not text.endswith("}"):
            raise YamlSubsetError(f"{where}: unterminated flow mapping {text!r}")
        out: dict[str, Any] = {}
        for item in _split_flow(text[1:-1], where):
            key, sep, value = item.partition(": ")
            if not sep:
                raise YamlSubsetError(f"{where}: {item!r} is not key: value")
            out[str(_scalar(key, where))] = _scalar(value, where)
        return out
    if text[:1] in ("|", ">", "&", "*", "!", "%", "@", "`"):
        raise YamlSubsetError(f"{where}: {text!r} is outside the YAML subset used here")
    if ": " in text or text.endswith(":"):
        raise YamlSubsetError(f"{where}: plain scalar {text!r} contains ': ' (quote it)")
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("null", "~", ""):
        return None
    if low in _AMBIGUOUS:
        raise YamlSubsetError(f"{where}: {text!r} is a boolean in YAML 1.1: quote it")
    if _INT.match(text):
        return int(text)
    return text


class _Doc:
    def __init__(self, lines: list[tuple[int, int, str]], name: str) -> None:
        self.lines = lines  # (line number, indent, text)
        self.name = name
        self.i = 0

    def where(self) -> str:
        line = self.lines[min(self.i, len(self.lines) - 1)][0]
        return f"{self.name}:{line}"

    def block(self, indent: int) -> Any:
        text = self.lines[self.i][2]
        if text == "-" or text.startswith("- "):
            return self.sequence(indent)
        if _KEY.match(text):
            return self.mapping(indent)
        value = _scalar(text, self.where())
        self.i += 1
        return value

    def nested(self, indent: int, allow_seq_same_indent: bool) -> Any:
        """The value of a ``key:`` or ``-`` with nothing after it: the next, deeper block."""
        if self.i < len(self.lines):
            _, ind, text = self.lines[self.i]
            if ind > indent or (
                allow_seq_same_indent and ind == indent and (text == "-" or text.startswith("- "))
            ):
                return self.block(ind)
        return None

    def sequence(self, indent: int) -> list[Any]:
        out: list[Any] = []
        while self.i < len(self.lines):
            no, ind, text = self.lines[self.i]
            if ind < indent:
                break
            if ind > indent:
                raise YamlSubsetError(f"{self.where()}: unexpected indentation")
            if not (text == "-" or text.startswith("- ")):
                break
            rest = text[1:].lstrip()
            if not rest:
                self.i += 1
                out.append(self.nested(indent, allow_seq_same_indent=False))
                continue
            # "- key: value" starts a mapping indented at the item's text.
            self.lines[self.i] = (no, ind + len(text) - len(rest), rest)
            out.append(self.block(ind + len(text) - len(rest)))
        return out

    def mapping(self, indent: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        while self.i < len(self.lines):
            _, ind, text = self.lines[self.i]
            if ind < indent:
                break
            if ind > indent:
                raise YamlSubsetError(f"{self.where()}: unexpected indentation")
            if text == "-" or text.startswith("- "):
                break
            m = _KEY.match(text)
            if m is None:
                raise YamlSubsetError(f"{self.where()}: expected 'key: value', got {text!r}")
            key = str(_scalar(m.group(1), self.where()))
            if key in out:
                raise YamlSubsetError(f"{self.where()}: duplicate key {key!r}")
            rest = m.group(2)
            if rest:
                out[key] = _scalar(rest, self.where())
                self.i += 1
            else:
                self.i += 1
                out[key] = self.nested(indent, allow_seq_same_indent=True)
        return out


def load_all(text: str, name: str) -> list[Any]:
    """The documents of ``text``, read as the YAML subset described above."""
    docs: list[list[tuple[int, int, str]]] = [[]]
    for no, raw in enumerate(text.splitlines(), 1):
        if "\t" in raw[: len(raw) - len(raw.lstrip())]:
            raise YamlSubsetError(f"{name}:{no}: tab in indentation")
        if raw.rstrip() == "---":
            docs.append([])
            continue
        if raw.startswith("..."):
            raise YamlSubsetError(f"{name}:{no}: document end marker is outside the subset")
        body = _strip_comment(raw)
        if body.strip():
            docs[-1].append((no, len(body) - len(body.lstrip(" ")), body.strip()))
    out = []
    for lines in docs:
        if not lines:
            continue
        doc = _Doc(lines, name)
        value = doc.block(lines[0][1])
        if doc.i != len(lines):
            raise YamlSubsetError(f"{doc.where()}: unexpected content")
        out.append(value)
    return out


def test_subset_parser_reads_what_yaml_does() -> None:
    text = (
        "a: 1\nb:\n- x\n- 'y: z' # comment\nc:\n  d: {}\n  e: [1, \"two\"]\n---\n"
        '- k: v\n  l:\n    - m: "n#o"\n'
    )
    assert load_all(text, "t") == [
        {"a": 1, "b": ["x", "y: z"], "c": {"d": {}, "e": [1, "two"]}},
        [{"k": "v", "l": [{"m": "n#o"}]}],
    ]
    for bad in ("a: 1\na: 2\n", "a: yes\n", "a: |\n  x\n", "a:\n\t- b\n", "a: b: c\n"):
        with pytest.raises(YamlSubsetError):
            load_all(bad, "t")


# ----------------------------------------------------------------- helpers


def manifest(name: str) -> list[dict[str, Any]]:
    path = DEPLOY / name
    docs = load_all(path.read_text(encoding="utf-8"), name)
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


def container_env(c: dict[str, Any]) -> dict[str, str]:
    """The container's environment as the kubelet builds it, in order, with downward API
    values from FIELD_VALUES."""
    env: dict[str, str] = {}
    for item in c.get("env", []):
        if "value" in item:
            env[item["name"]] = expand(str(item["value"]), env)
        else:
            path = item["valueFrom"]["fieldRef"]["fieldPath"]
            assert path in FIELD_VALUES, f"env {item['name']}: unexpected fieldPath {path!r}"
            env[item["name"]] = FIELD_VALUES[path]
    return env


def agent_argv(c: dict[str, Any]) -> list[str]:
    env = container_env(c)
    words = [expand(str(w), env) for w in [*c["command"], *c.get("args", [])]]
    left = [w for w in words if "$(" in w]
    assert not left, f"undefined $(VAR) references: {left}"
    assert words[0] == "elastrun", words
    return words[1:]


def agent_pod_spec(name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    docs = manifest(name)
    workload = one(docs, "Job" if name == "job.yaml" else "StatefulSet")
    return workload, workload["spec"]["template"]["spec"]


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
    assert {"etcd.yaml", "job.yaml", "statefulset.yaml"} <= names


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_every_document_parses_and_is_a_k8s_object(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    docs = load_all(text, path.name)
    assert docs
    for doc in docs:
        assert isinstance(doc, dict)
        assert doc.get("apiVersion") and doc.get("kind"), doc
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", doc["metadata"]["name"])
    try:
        import yaml  # type: ignore[import-untyped,unused-ignore]
    except ImportError:
        return
    assert list(yaml.safe_load_all(text)) == docs


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_services_and_workloads_select_their_pods(path: Path) -> None:
    docs = manifest(path.name)
    pods = [
        d["spec"]["template"]["metadata"]["labels"]
        for d in docs
        if d["kind"] in ("Job", "StatefulSet")
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
    c = container(pod, "elastrun")
    argv = agent_argv(c)
    # The image's WORKDIR holds examples/ as the repository root does: resolve the script there.
    assert c["workingDir"] == "/app"
    monkeypatch.chdir(ROOT)
    plan, cmd = parse(argv)

    assert plan.backend == "etcd"
    assert not plan.standalone
    assert plan.config.local_addr == FIELD_VALUES["status.podIP"]
    assert plan.config.max_restarts >= 1
    assert plan.conf["key_prefix"] == f"/elastrun-k8s/{FIELD_VALUES['metadata.namespace']}"
    assert plan.conf["lease_ttl"] > 0
    if name == "job.yaml":
        label = FIELD_VALUES["metadata.labels['batch.kubernetes.io/controller-uid']"]
        assert plan.config.run_id.endswith(label), "the run id must be unique per Job"

    # N pods within the elastic range
    spec = workload["spec"]
    pods = spec["parallelism"] if name == "job.yaml" else spec["replicas"]
    assert plan.config.min_nodes <= pods <= plan.config.max_nodes
    assert plan.config.min_nodes < plan.config.max_nodes, "elastic: MIN < MAX"

    # the etcd endpoints are the etcd StatefulSet's members, through its headless Service
    sts = etcd_statefulset()
    members = [
        (f"{sts['metadata']['name']}-{i}.{sts['spec']['serviceName']}", 2379)
        for i in range(sts["spec"]["replicas"])
    ]
    assert list(plan.endpoints) == members

    # terminationGracePeriodSeconds outlasts the workers' SIGTERM -> SIGKILL grace
    grace = pod["terminationGracePeriodSeconds"]
    assert grace > plan.config.shutdown_timeout + 10, (grace, plan.config.shutdown_timeout)

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
    _, pod = agent_pod_spec(name)
    argv = agent_argv(container(pod, "elastrun"))
    script_at = argv.index("examples/train.py")
    spec = importlib.util.spec_from_file_location("k8s_example_train", ROOT / "examples/train.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    ns = module.parse_args(argv[script_at + 1 :])
    assert ns.checkpoint_dir == "/ckpt"


def test_agent_pods_reach_each_other_and_etcd() -> None:
    docs = manifest("job.yaml")
    job = one(docs, "Job", "train")
    pod = job["spec"]["template"]["spec"]
    assert one(docs, "Service", pod["subdomain"])["spec"]["clusterIP"] == "None"
    # Both manifests run the same agent command line (one of them must not drift).
    _, sts_pod = agent_pod_spec("statefulset.yaml")
    job_args = container(pod, "elastrun")["args"]
    assert container(sts_pod, "elastrun")["args"] == job_args


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
    copied = {w for line in text.splitlines() if line.startswith("COPY ") for w in line.split()}
    for needed in ("pyproject.toml", "README.md", "src"):  # what pip needs to build elastrun
        assert needed in copied


def test_docs_name_files_that_exist_and_commands_that_parse(clean_env: None) -> None:
    text = (ROOT / "docs" / "kubernetes.md").read_text(encoding="utf-8")
    for rel in set(re.findall(r"deploy/kubernetes/[\w.]+", text)):
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
        assert flags["--rdzv-backend"] == "etcd", line
        endpoint = flags["--rdzv-endpoint"]
        assert endpoint in (env["RDZV_ENDPOINT"], "127.0.0.1:2379", "$RDZV_ENDPOINT"), line
