"""`primebuild render`: the artifacts of the cluster targets — golden files, `bash -n`, the Kubernetes
schemas (kubernetes-validate) and the JobSet / LeaderWorkerSet CRD schemas (tests/data/crds/).

Golden files change only on purpose: `PRIMEBUILD_UPDATE_GOLDEN=1 pytest tests/test_render.py` rewrites
them, and the diff is reviewed like code.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml
from conftest import MANIFESTS, REPO, run_cli

GOLDEN = REPO / "tests" / "golden"
CRDS = REPO / "tests" / "data" / "crds"
K8S_VERSION = "1.33"
FIXED = ["--run-dir", "/shared/runs/demo", "--python", "/opt/primebuild/.venv/bin/python"]
# glm5 as it would run from a pushed image, pinned by digest (pyxis on Slurm, the pods' image on Kubernetes)
IMAGE = ["--image", "registry.example.com/rl/primebuild:latest", "--image-digest", "sha256:" + "5e" * 32,
         "--container-mount", "/shared/store"]
CASES = [("glm5.yaml", "slurm", "glm5.sbatch"), ("glm5.yaml", "kubernetes", "glm5.kubernetes.yaml"),
         ("reverse-text.yaml", "kubernetes", "reverse-text.kubernetes.yaml"),
         ("reverse-text-slurm.yaml", "slurm", "reverse-text-slurm.sbatch"),
         ("reverse-text-ssh.yaml", "ssh", "reverse-text-ssh.sh")]


def rendered(manifest: str, target: str, *extra: str) -> str:
    python = ["--run-dir", "/shared/runs/demo", "--python", "python3"] if target == "kubernetes" else FIXED
    result = run_cli("render", MANIFESTS / manifest, "--target", target, *python, *extra, timeout=60)
    assert result.code == 0, result.text
    return result.out


@pytest.mark.parametrize(("manifest", "target", "golden"), CASES, ids=[c[2] for c in CASES])
def test_rendered_artifacts_match_their_golden_files(manifest, target, golden):
    text = rendered(manifest, target, *(IMAGE if manifest == "glm5.yaml" else ()))
    path = GOLDEN / golden
    if os.environ.get("PRIMEBUILD_UPDATE_GOLDEN"):
        path.write_text(text)
    assert path.is_file(), f"no golden file {path}: run with PRIMEBUILD_UPDATE_GOLDEN=1 and review it"
    assert text == path.read_text(), f"{golden} changed: review the diff, then PRIMEBUILD_UPDATE_GOLDEN=1"


@pytest.mark.parametrize("golden", ["glm5.sbatch", "reverse-text-slurm.sbatch", "reverse-text-ssh.sh"])
def test_rendered_scripts_are_bash(golden, tmp_path):
    done = subprocess.run(["bash", "-n", str(GOLDEN / golden)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr


def test_glm5_is_one_het_job_with_a_component_per_group():
    text = (GOLDEN / "glm5.sbatch").read_text()
    headers = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    components = [h for h in headers if h.startswith("#SBATCH --nodes=")]
    assert len(components) == 4 and headers.count("#SBATCH hetjob") == 3  # prefill, decode, trainer, orchestrator
    assert components[0].startswith("#SBATCH --nodes=4 ") and "--gres=gpu:8" in components[0]
    assert components[1].startswith("#SBATCH --nodes=12 ") and components[2].startswith("#SBATCH --nodes=12 ")
    assert "--gres" not in components[3]
    assert text.count("exec srun --het-group=") == 4 + 12 + 12 + 1
    assert "--het-group=2 " in text and "--kill-on-bad-exit=1" in text
    assert "DESIGN STUDY, NOT RUNNABLE" in text and "inference.disaggregation" in text  # rendered, but marked
    assert "HF_TOKEN" in text and "WANDB_API_KEY" in text  # named …
    assert "SLURM_JOB_NODELIST_HET_GROUP_3" in text


def test_run_refuses_what_render_marks_not_runnable(tmp_path):
    result = run_cli("run", MANIFESTS / "glm5.yaml", "--runs-dir", tmp_path, timeout=60)
    assert result.code == 2 and "inference.disaggregation" in result.err and "Traceback" not in result.err
    assert not any(tmp_path.iterdir())


def _objects(golden: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((GOLDEN / golden).read_text()) if d]


def _pod_templates(obj: dict) -> list[dict]:
    if obj["kind"] == "JobSet":
        return [rj["template"] for rj in obj["spec"]["replicatedJobs"]]
    if obj["kind"] == "LeaderWorkerSet":
        t = obj["spec"]["leaderWorkerTemplate"]
        return [t["leaderTemplate"], t["workerTemplate"]]
    return []


@pytest.mark.parametrize("golden", ["glm5.kubernetes.yaml", "reverse-text.kubernetes.yaml"])
def test_kubernetes_objects_validate_against_the_schemas(golden):
    # a test extra from PyPI (not in nixpkgs: the flake's check skips this one test)
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    crds = {"JobSet": json.loads((CRDS / "jobset-v1alpha2.json").read_text()),
            "LeaderWorkerSet": json.loads((CRDS / "leaderworkerset-v1.json").read_text())}
    kinds = []
    for obj in _objects(golden):
        kinds.append(obj["kind"])
        if obj["kind"] in crds:
            jsonschema.validate(obj, crds[obj["kind"]])
            for i, template in enumerate(_pod_templates(obj)):
                # the embedded templates against Kubernetes' own schemas: a Job (JobSet) or a Pod (LWS)
                if obj["kind"] == "JobSet":
                    doc = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": f"t{i}"},
                           "spec": template["spec"]}
                else:
                    doc = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"t{i}", **template.get(
                        "metadata", {})}, "spec": template["spec"]}
                kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        else:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    assert kinds.count("JobSet") == 1 and "Service" in kinds and "ConfigMap" in kinds
    if golden.startswith("glm5"):
        assert "LeaderWorkerSet" in kinds  # decode replicas span 2 nodes


def test_a_misspelt_field_fails_the_crd_schema():
    """The CRD schemas are closed where primebuild writes: they catch what they are there to catch."""
    jobset = next(o for o in _objects("reverse-text.kubernetes.yaml") if o["kind"] == "JobSet")
    jobset["spec"]["startupPolicy"] = {"startupPolicyOrdr": "InOrder"}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(jobset, json.loads((CRDS / "jobset-v1alpha2.json").read_text()))


def test_kubernetes_wiring_is_consistent():
    objects = {o["kind"]: o for o in _objects("reverse-text.kubernetes.yaml")}
    plan = json.loads(objects["ConfigMap"]["data"]["plan.json"])
    rendezvous = json.loads(objects["ConfigMap"]["data"]["rendezvous.json"])
    jobset = objects["JobSet"]
    assert [rj["name"] for rj in jobset["spec"]["replicatedJobs"]] == ["inference", "trainer", "orchestrator"]
    assert jobset["spec"]["network"]["subdomain"] == objects["Service"]["metadata"]["name"]
    # plan node 0's address is the inference pod's DNS name (it listens; the others only connect)
    assert rendezvous["hosts"] == ["reverse-text-inference-0-0.reverse-text"]
    assert plan["plan_hash"] and jobset["spec"]["failurePolicy"] == {"maxRestarts": 0}
    text = (GOLDEN / "reverse-text.kubernetes.yaml").read_text()
    assert "secretKeyRef" in text


def test_secrets_are_named_never_written(tmp_path, monkeypatch):
    """Secret values in the environment of `render` never reach an artifact; their names do."""
    secret = "s3cr3t-value-that-must-not-leak"
    for target in ("slurm", "kubernetes", "ssh"):
        manifest = "glm5.yaml" if target != "ssh" else "qwen3-30b-a3b.yaml"
        result = run_cli("render", MANIFESTS / manifest, "--target", target, "--run-dir", "/r/x", timeout=60,
                         env={"HF_TOKEN": secret, "WANDB_API_KEY": secret, "PRIMEBUILD_ADMIN_TOKEN": secret})
        assert result.code == 0, result.text
        assert secret not in result.out and "HF_TOKEN" in result.out


def test_values_that_reach_a_shell_run_nothing_unintended(tmp_path):
    """A run folder and an ssh workdir full of shell metacharacters: the rendered scripts, executed,
    create the folders they name and nothing else. (The cluster tests also submit such a run for real.)"""
    nasty = tmp_path / "runs $(touch PWNED1) `touch PWNED2`; touch PWNED3 'q' \"dq\" &x |y"
    slurm = rendered("reverse-text-slurm.yaml", "slurm", "--run-dir", str(nasty / "run"))
    script = tmp_path / "job.sbatch"
    script.write_text(slurm)
    # Executed outside a job: the prologue runs (quoted assignments, the rendezvous call) and fails for
    # want of a run folder; nothing that a name smuggled in may run.
    subprocess.run(["bash", str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                   env={**os.environ, "SLURM_JOB_NODELIST_HET_GROUP_0": "", "PATH": os.environ["PATH"]})
    ssh = rendered("reverse-text-ssh.yaml", "ssh", "--run-dir", str(nasty / "run"), "--set",
                   f"target.workdir={nasty / 'work'}")
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    # `ssh` here runs the remote command through a local shell, exactly as sshd hands it to the login shell
    (fake_bin / "ssh").write_text("#!/bin/bash\nwhile [[ $1 == -* ]]; do shift 2; done; shift; exec bash -c \"$*\"\n")
    (fake_bin / "ssh").chmod(0o755)
    (nasty / "run").mkdir(parents=True)
    shutil.copy(MANIFESTS / "reverse-text.yaml", nasty / "run" / "plan.json")  # any file: the worker fails later
    done = subprocess.run(["bash", "-c", ssh], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PATH": f"{fake_bin}:{os.environ['PATH']}",
                               "PRIMEBUILD_ADMIN_TOKEN": "t"})
    assert "No such file or directory" in done.stderr and str(nasty / "work") in done.stderr  # the quoted path
    leaked = [p for p in tmp_path.rglob("PWNED*")] + [p for p in Path.cwd().glob("PWNED*")]
    assert not leaked, leaked


def test_run_on_kubernetes_without_a_cluster_refuses_and_points_at_render(tmp_path):
    """No kube context here (or no client): `run` says so before anything is written; `render` still works."""
    result = run_cli("run", MANIFESTS / "reverse-text.yaml", "--set", "target={kind: kubernetes}", "--runs-dir",
                     tmp_path / "runs", timeout=120, env={"KUBECONFIG": str(tmp_path / "none"),
                                                          "KUBERNETES_SERVICE_HOST": ""})
    assert result.code == 2 and "target kubernetes" in result.err and "Traceback" not in result.err
    assert "render" in result.err and not (tmp_path / "runs").exists()


def test_glm5_steps_and_pods_run_the_image_by_digest():
    """With --image-digest every Slurm step runs in the image through pyxis and every pod pulls it by
    digest (a tag can move; the digest is the bytes `primebuild build` made)."""
    digest = IMAGE[IMAGE.index("--image-digest") + 1]
    sbatch = (GOLDEN / "glm5.sbatch").read_text()
    steps = [line for line in sbatch.splitlines() if line.strip().startswith("exec srun")]
    assert len(steps) == 29  # 4 prefill + 12 decode + 12 trainer nodes, and the orchestrator
    assert all(f"--container-image=registry.example.com#rl/primebuild@{digest}'" in s for s in steps)
    assert sbatch.count("/usr/bin/python3 -m primebuild.cli worker") == 29
    images = re.findall(r"^\s+image: (\S+)$", (GOLDEN / "glm5.kubernetes.yaml").read_text(), re.M)
    assert images and set(images) == {f"registry.example.com/rl/primebuild@{digest}"}
    plain = rendered("reverse-text-slurm.yaml", "slurm")  # no image: the nodes' own installation
    assert "--container-image" not in plain
