"""`primebuild render MANIFEST --target slurm|ssh|kubernetes [-o DIR]`: the exact artifacts a target submits.

Pure, like `plan`: nothing is submitted or started. One file goes to stdout; with `-o DIR` every file is
written there. A plan that no built backend can run (a design study such as glm5) still renders, with a
header that lists what is not runnable; `primebuild run` refuses it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from primebuild.commands.options import manifest_argument, print_notes, set_option
from primebuild.errors import Problem, UserError


@click.command("render")
@manifest_argument
@set_option
@click.option("--target", "target", type=click.Choice(["slurm", "ssh", "kubernetes"]), default=None,
              help="Render for this target (default: the manifest's own target.kind).")
@click.option("-o", "--output", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Write the artifacts into this folder instead of stdout.")
@click.option("--run-dir", default=None,
              help="The run folder the artifacts name (default: RUNS/<name>, absolute; slurm: runs/<name> under the "
                   "folder sbatch runs in, and a relative --run-dir is relative to it). On a cluster it must be on a "
                   "filesystem every node sees.")
@click.option("--python", "python", default=None,
              help="The interpreter with primebuild on the nodes (default: this one; slurm: "
                   "python3 on the batch host's PATH, or PRIMEBUILD_PYTHON at submission).")
@click.option("--model-path", default=None,
              help="kubernetes: the model folder as the pods see it (default: RUN_DIR/model).")
@click.option("--image", default=None,
              help="Where the image of `primebuild build` was pushed (REGISTRY/NAME): kubernetes pods run it (default "
                   "primebuild:latest), slurm steps run in it with pyxis (default: no container).")
@click.option("--image-digest", default=None, metavar="sha256:…",
              help="The digest `primebuild build` printed: the artifacts then name the image by digest.")
@click.option("--container-mount", "mounts", multiple=True, metavar="PATH",
              help="slurm with an image: a host path mounted into every step at the same path (e.g. the store).")
def command(manifest: str, sets: tuple[str, ...], target: str | None, out_dir: Path | None, run_dir: str | None,
            python: str | None, model_path: str | None, image: str | None, image_digest: str | None,
            mounts: tuple[str, ...]) -> None:
    """Render MANIFEST's plan as the artifacts of a cluster target."""
    from primebuild.builders.plan import compile_plan, located
    from primebuild.builders.render import render
    from primebuild.builders.render.groups import checked_image
    from primebuild.contracts.render import RenderContext
    from primebuild.manifest.load import load_manifest

    loaded = load_manifest(manifest, sets)
    if target and target != loaded.manifest.target.kind:  # the target's own settings at their defaults
        try:
            loaded = load_manifest(manifest, [*sets, f"target={{kind: {target}}}"])
        except UserError as err:  # a setting the target has no default for (ssh: its hosts)
            first = err.problems[0]
            raise UserError(f"--target {target}: {first.field or 'target'}: {first.message}",
                            hint=f"give it too: --set 'target={{kind: {target}, ...}}', or render a manifest whose "
                                 f"target is {target} (manifests/reverse-text-{target}.yaml)") from None
    print_notes(loaded.notes)
    kind = loaded.manifest.target.kind
    if kind == "local":
        raise UserError("the local target has nothing to render: `primebuild plan` shows what it starts",
                        hint="give --target slurm, ssh or kubernetes")
    plan = compile_plan(loaded, design=True)  # a design study renders too, marked as such
    if plan.build is not None:
        raise UserError(f"{manifest}: an sft: manifest is one store build, not processes on a cluster")
    # a design study may ask for what no backend applies, but the target's own settings must describe a
    # cluster the artifact can address (ssh: a host for every plan node), and its objects need valid names
    if unaddressable := [u for u in plan.unsupported if u.field.startswith("target.") or u.field == "name"]:
        raise UserError(located(loaded, [Problem(u.message, field=u.field, hint=u.hint) for u in unaddressable]))
    checked_image(image)
    _refuse_flags_without_effect(kind, python=python, image=image, image_digest=image_digest, mounts=mounts,
                                 model_path=model_path)
    for mount in mounts:
        if not mount.startswith("/") or any(ch in mount for ch in ",:\n"):
            raise UserError(f"--container-mount {mount!r}: give an absolute path without ',' or ':' (pyxis separators)")
    if image_digest:
        from primebuild.builders.lock import plan_with_image

        plan = plan_with_image(plan, image_digest)
    if kind == "slurm":  # nothing of this machine baked in: paths resolve on the cluster
        run_dir = run_dir or f"runs/{plan.name}"
        python = python or "python3"
    run_dir = run_dir or str((Path("runs") / plan.name).resolve())
    if not run_dir.startswith("/") and kind != "slurm":
        raise UserError(f"--run-dir {run_dir}: give an absolute path (the same on every node)")
    if python is None:  # kubernetes: the image's interpreter; ssh: this one, at the same path on the nodes
        python = "python3" if kind == "kubernetes" else sys.executable
    files = render(plan, kind, RenderContext(run_dir=run_dir, python=python, image=image, mounts=list(mounts),
                                             model_path=model_path or f"{run_dir}/model"))
    if out_dir is None:
        if len(files) != 1:
            raise UserError(f"{len(files)} files: give -o DIR")
        click.echo(next(iter(files.values())), nl=False)
        return
    for name, text in files.items():
        click.echo(str(_write(out_dir, name, text)))


def _refuse_flags_without_effect(kind: str, *, python: str | None, image: str | None, image_digest: str | None,
                                 mounts: tuple[str, ...], model_path: str | None) -> None:
    """A flag the chosen target would not read is an error, as a manifest field is."""
    if python is not None and not python.strip():
        raise UserError("--python: give the interpreter's path on the nodes (it is empty)")
    if python is not None and kind == "ssh":
        raise UserError("--python: the ssh target runs target.workdir's interpreter (<workdir>/.venv/bin/python) on "
                        "each host", hint="set target.workdir to the primebuild install on the hosts")
    for flag, given in (("--image", image), ("--image-digest", image_digest)):
        if given is not None and kind == "ssh":
            raise UserError(f"{flag}: the ssh target runs primebuild from target.workdir on each host, in no "
                            "container", hint="render --target slurm or kubernetes to run the image")
    if mounts and (kind != "slurm" or image is None):
        raise UserError("--container-mount: mounts a host path into a slurm step's container; it needs --target "
                        "slurm and --image")
    if model_path is not None and kind != "kubernetes":
        raise UserError(f"--model-path: the kubernetes pods' model folder; the {kind} target resolves the model "
                        "at start")


def _write(out_dir: Path, name: str, text: str) -> Path:
    """`out_dir/name`, written whole or not at all (a temporary file renamed into place)."""
    from primebuild.contracts.run_dir import write_text_atomic

    path = out_dir / name
    try:
        write_text_atomic(path, text)
    except OSError as err:
        raise UserError(f"-o {out_dir}: cannot write {name}: {err.strerror}",
                        hint="give -o a folder you can write, or leave it out for stdout") from None
    return path

