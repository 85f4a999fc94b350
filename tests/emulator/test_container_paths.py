"""Where a task runs and what its volume shows: a container's ``workingDir``, and a GCS volume's
``only-dir`` mount option with volumes as plain folders (``serve --volumes folder``).

Before, the emulator ran every attempt in the image entry's ``cwd`` whatever ``workingDir`` said
(a relative or missing one too), and in folder mode a task saw the whole bucket despite
``only-dir``.
"""

from __future__ import annotations

import pytest
from google.auth.credentials import AnonymousCredentials
from google.cloud import run_v2

from cloud_run_emulator.process import EmulatorProcess

from .conftest import PARENT, make_job, task_name


def _run(jobs, job_id: str, spec: run_v2.Job):
    job = jobs.create_job(parent=PARENT, job=spec, job_id=job_id).result(timeout=10)
    op = jobs.run_job(name=job.name)
    try:
        op.result(timeout=30)
    except Exception:  # a failed execution: the caller looks at its task
        pass
    return op.metadata.name


def _pwd_job(out, working_dir: str, bucket=None) -> run_v2.Job:
    spec = make_job("local/pwd", env={"OUT": str(out)}, max_retries=0, bucket=bucket)
    spec.template.template.containers[0].working_dir = working_dir
    return spec


@pytest.mark.parametrize("working_dir, expected", [
    ("", "."), ("/src", "."), ("/src/sub/", "sub"), ("TMP", "TMP"),
], ids=["unset", "image-workdir", "below-image-workdir", "absolute"])
def test_working_dir_is_where_the_task_runs(jobs, job_id, images_file, tmp_path, working_dir, expected):
    (images_file.parent / "sub").mkdir(exist_ok=True)
    folders = {".": images_file.parent, "sub": images_file.parent / "sub", "TMP": tmp_path}
    _run(jobs, job_id, _pwd_job(tmp_path / "pwd.txt", str(tmp_path) if working_dir == "TMP" else working_dir))
    assert (tmp_path / "pwd.txt").read_text().strip() == str(folders[expected].resolve())


def test_working_dir_in_a_gcs_volume_is_that_folder_of_the_bucket(jobs, job_id, emulator, bucket, tmp_path):
    (emulator.bucket_dir(bucket.name) / "work").mkdir(parents=True)
    _run(jobs, job_id, _pwd_job("/checkpoints/pwd.txt", "/checkpoints/work", bucket=bucket.name))
    assert (emulator.bucket_dir(bucket.name) / "pwd.txt").read_text().strip().endswith(f"{bucket.name}/work")


@pytest.mark.parametrize("working_dir, message", [
    ("work", "workingDir 'work' is not an absolute path"),
    ("/no/such/folder", "workingDir '/no/such/folder' is not an existing folder"),
    ("/src/missing", "workingDir '/src/missing' (here "),
], ids=["relative", "missing", "missing-below-image-workdir"])
def test_a_relative_or_missing_working_dir_fails_the_attempt(jobs, tasks, job_id, tmp_path, working_dir, message):
    name = _run(jobs, job_id, _pwd_job(tmp_path / "pwd.txt", working_dir))
    task = tasks.get_task(name=task_name(name, 0))
    assert task.conditions[-1].state == run_v2.Condition.State.CONDITION_FAILED
    assert "The container failed to start: " + message in task.last_attempt_result.status.message
    assert not (tmp_path / "pwd.txt").exists()


def test_a_working_dir_leading_out_of_a_volume_is_refused(jobs, job_id, bucket, tmp_path):
    from google.api_core import exceptions as gexc

    with pytest.raises(gexc.BadRequest, match=r"containers\[0\].working_dir: '/checkpoints/../x' leads out"):
        jobs.create_job(parent=PARENT, job=_pwd_job(tmp_path / "pwd.txt", "/checkpoints/../x", bucket=bucket.name),
                        job_id=job_id).result(timeout=10)


def test_only_dir_with_folder_volumes_shows_the_task_that_folder_of_the_bucket(tmp_path, images_file):
    from google.cloud import storage

    with EmulatorProcess(tmp_path / "emu", images_file=images_file, extra_args=["--volumes", "folder"]) as emu:
        assert emu.volumes()["type"] == "folder"
        opts = {"credentials": AnonymousCredentials(), "client_options": {"api_endpoint": emu.gcs_endpoint}}
        bucket = storage.Client(project="test-project", **opts).create_bucket("only-dir-folders")
        spec = make_job("local/sh", args=['ls -A "$DIR" > "$DIR/seen.txt"'], env={"DIR": "/checkpoints"},
                        max_retries=0, bucket=bucket.name)
        spec.template.template.volumes[0].gcs.mount_options = ["only-dir=runs/a"]
        bucket.blob("top.txt").upload_from_string(b"outside the folder")
        jobs = run_v2.JobsClient(credentials=AnonymousCredentials(), transport="rest",
                                 client_options={"api_endpoint": emu.endpoint})
        _run(jobs, "only-dir", spec)
        assert bucket.blob("runs/a/seen.txt").download_as_bytes() == b"seen.txt\n"  # not top.txt
        assert not bucket.blob("seen.txt").exists()
