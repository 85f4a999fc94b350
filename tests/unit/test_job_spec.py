"""Table tests for GpuJobSpec validation and its run_v2.Job mapping."""

from __future__ import annotations

import warnings

import pytest
from google.api import launch_stage_pb2
from google.cloud import run_v2

from airflow_gpu_resilience.job_spec import (
    GpuJobSpec,
    parse_cpu,
    parse_memory_gib,
    template_matches,
    validate_bucket_name,
)

BASE = {"name": "train-job", "image": "us-docker.pkg.dev/p/r/worker:1", "checkpoint_bucket": "ckpt-bucket"}


def spec(**overrides) -> GpuJobSpec:
    return GpuJobSpec(**{**BASE, **overrides})


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"gpu_type": "nvidia-a100"}, r"gpu_type='nvidia-a100' is not supported; allowed: \['nvidia-l4', 'nvidia-rtx-pro-6000'\]"),
        ({"gpu_count": 2}, r"gpu_count=2: Cloud Run allows exactly 1 GPU"),
        ({"max_retries": 11}, r"max_retries=11 is out of range: allowed integers are 0-10"),
        ({"max_retries": -1}, r"max_retries=-1 is out of range"),
        ({"max_retries": True}, r"max_retries=True is out of range"),
        ({"task_timeout": 0}, r"task_timeout=0 s is out of range: allowed 1-604800 seconds"),
        ({"task_timeout": -5}, r"task_timeout=-5 s is out of range"),
        ({"task_timeout": 168 * 3600 + 1}, r"task_timeout=604801 s is out of range"),
        ({"task_timeout": "3600"}, r"task_timeout='3600' must be an integer of seconds"),
        ({"cpu": "2"}, r"cpu='2' is below the nvidia-l4 minimum of 4 vCPU"),
        ({"cpu": "3500m"}, r"cpu='3500m' is below the nvidia-l4 minimum of 4 vCPU"),
        ({"cpu": "four"}, r"cpu='four' is not a CPU quantity"),
        ({"memory": "8Gi"}, r"memory='8Gi' is below the nvidia-l4 minimum of 16 GiB"),
        ({"memory": "16G"}, r"memory='16G' is below the nvidia-l4 minimum of 16 GiB"),
        ({"memory": "lots"}, r"memory='lots' is not a memory quantity"),
        ({"gpu_type": "nvidia-rtx-pro-6000"}, r"cpu='4' is below the nvidia-rtx-pro-6000 minimum of 20 vCPU"),
        ({"gpu_type": "nvidia-rtx-pro-6000", "cpu": "20"}, r"memory='16Gi' is below the nvidia-rtx-pro-6000 minimum of 80 GiB"),
        ({"image": ""}, r"image must be a non-empty container image URI"),
        ({"image": "   "}, r"image must be a non-empty"),
        ({"name": "Train"}, r"name='Train' is not a valid Cloud Run job name"),
        ({"name": "1job"}, r"name='1job' is not a valid Cloud Run job name"),
        ({"name": "job-"}, r"name='job-' is not a valid"),
        ({"name": "j" * 64}, r"is not a valid Cloud Run job name"),
        ({"name": "job_name"}, r"is not a valid Cloud Run job name"),
        ({"checkpoint_bucket": "gs://bucket"}, r"checkpoint_bucket='gs://bucket' is not a valid Cloud Storage bucket name"),
        ({"checkpoint_bucket": "ab"}, r"length must be 3-63 characters"),
        ({"checkpoint_bucket": "a" * 64}, r"length must be 3-63 characters"),
        ({"checkpoint_bucket": "Bucket"}, r"is not a valid Cloud Storage bucket name"),
        ({"checkpoint_bucket": "-bucket"}, r"starting and ending with a letter or digit"),
        ({"checkpoint_bucket": "192.168.1.1"}, r"must not be an IP address"),
        ({"checkpoint_bucket": "goog-bucket"}, r"must not start with 'goog'"),
        ({"checkpoint_bucket": "my-google-bucket"}, r"contain 'google'"),
        ({"checkpoint_bucket": "a." + "b" * 64}, r"each dot-separated part must be 1-63"),
        ({"checkpoint_mount_path": "checkpoints"}, r"checkpoint_mount_path='checkpoints' must be an absolute path"),
        ({"checkpoint_mount_path": "/"}, r"must be an absolute path other than '/'"),
        ({"task_count": 0}, r"task_count=0 is out of range: allowed integers are 1-10000"),
        ({"parallelism": -1}, r"parallelism=-1 is out of range"),
        ({"env": {"CLOUD_RUN_TASK_INDEX": "3"}}, r"env\['CLOUD_RUN_TASK_INDEX'\]: name 'CLOUD_RUN_TASK_INDEX' is reserved by Cloud Run"),
        ({"env": {"A=B": "3"}}, r"env\['A=B'\]: name 'A=B' must not contain '=' or NUL"),
        ({"env": {"": "3"}}, r"env\[''\]: name '' must be a non-empty string"),
        ({"env": {"X": "a\x00b"}}, r"env\['X'\]: value of 'X' must not contain NUL"),
        ({"env": {"X": 3}}, r"env\['X'\]: value 3 of 'X' must be a string"),
        ({"env": {"CHECKPOINT_DIR": "/elsewhere"}}, r"contradicts checkpoint_mount_path='/checkpoints'"),
        ({"env": {"TASK_TIMEOUT_SECONDS": "10"}}, r"env\[.TASK_TIMEOUT_SECONDS.\]=.10. contradicts task_timeout=3600; leave it unset"),
        ({"labels": {"run.googleapis.com/x": "y"}}, r"uses a prefix Cloud Run reserves"),
        ({"labels": {"Team": "ml"}}, r"label key 'Team' is invalid"),
        ({"labels": {"team": "ML"}}, r"label team='ML' is invalid"),
    ],
)
def test_invalid_spec_raises_one_clear_error(overrides, match):
    with pytest.raises(ValueError, match=match):
        spec(**overrides)


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"cpu": "8", "memory": "32Gi"},
        {"cpu": "4000m", "memory": "16384Mi"},
        {"memory": "17179869184"},
        {"gpu_type": "nvidia-rtx-pro-6000", "cpu": "20", "memory": "80Gi"},
        {"task_timeout": 168 * 3600},
        {"max_retries": 10},
        {"checkpoint_bucket": "my.bucket.with.dots"},
        {"checkpoint_bucket": "abc"},
        {"name": "j" * 63},
        {"env": {"CHECKPOINT_DIR": "/checkpoints"}},
        {"labels": {"team": "ml", "empty": ""}},
    ],
)
def test_valid_spec(overrides):
    assert spec(**overrides).to_job().template.template.containers[0].image == BASE["image"]


def test_numeric_cpu_and_memory_become_strings():
    limits = spec(cpu=8, memory=32 * 1024**3).to_job().template.template.containers[0].resources.limits
    assert (limits["cpu"], limits["memory"]) == ("8", "34359738368")
    assert spec(cpu=4.5).cpu == "4.5"


def test_max_retries_zero_warns():
    with pytest.warns(UserWarning, match="max_retries=0"):
        spec(max_retries=0)


def test_no_checkpoint_bucket_warns_and_mounts_nothing():
    with pytest.warns(UserWarning, match="checkpoint_bucket is None"):
        job = spec(checkpoint_bucket=None).to_job()
    task = job.template.template
    assert list(task.volumes) == []
    assert list(task.containers[0].volume_mounts) == []
    assert "CHECKPOINT_DIR" not in {e.name for e in task.containers[0].env}


def test_from_dict_rejects_unknown_keys():
    with pytest.raises(ValueError, match=r"unknown GpuJobSpec field\(s\) \['gpus'\]"):
        GpuJobSpec.from_dict({**BASE, "gpus": 1})


def test_to_job_mirrors_gcloud_deploy():
    job = spec(
        command=["python"], args=["-m", "gpu_resilience_trainer"], env={"A": "1"}, service_account="sa@p.iam.gserviceaccount.com",
        task_timeout=168 * 3600, task_count=2, parallelism=1, labels={"team": "ml"},
    ).to_job()
    task = job.template.template
    container = task.containers[0]
    assert job.launch_stage == launch_stage_pb2.LaunchStage.BETA
    assert job.labels == {"team": "ml"}
    assert (job.template.task_count, job.template.parallelism) == (2, 1)
    assert container.image == BASE["image"]
    assert list(container.command) == ["python"] and list(container.args) == ["-m", "gpu_resilience_trainer"]
    assert [(e.name, e.value) for e in container.env] == [
        ("A", "1"), ("CHECKPOINT_DIR", "/checkpoints"), ("TASK_TIMEOUT_SECONDS", "604800")]
    assert dict(container.resources.limits) == {"cpu": "4", "memory": "16Gi", "nvidia.com/gpu": "1"}
    assert [(m.name, m.mount_path) for m in container.volume_mounts] == [("checkpoint-volume", "/checkpoints")]
    assert [(v.name, v.gcs.bucket) for v in task.volumes] == [("checkpoint-volume", "ckpt-bucket")]
    assert task.max_retries == 3 and "max_retries" in task
    assert task.timeout.total_seconds() == 168 * 3600
    assert task.node_selector.accelerator == "nvidia-l4"
    assert task.gpu_zonal_redundancy_disabled is True
    assert task.service_account == "sa@p.iam.gserviceaccount.com"


def test_max_retries_zero_is_serialized():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        job = spec(max_retries=0).to_job()
    assert '"maxRetries": 0' in run_v2.Job.to_json(job)


@pytest.mark.parametrize(
    ("overrides", "preview"),
    [
        ({}, False),
        ({"task_timeout": 3600}, False),
        ({"task_timeout": 3601}, True),
        ({"gpu_type": "nvidia-rtx-pro-6000", "cpu": "20", "memory": "80Gi"}, True),
    ],
)
def test_launch_stage_beta_only_for_preview_features(overrides, preview):
    job = spec(**overrides).to_job()
    assert spec(**overrides).needs_preview is preview
    expected = launch_stage_pb2.LaunchStage.BETA if preview else launch_stage_pb2.LaunchStage.LAUNCH_STAGE_UNSPECIFIED
    assert job.launch_stage == expected


def test_zonal_redundancy_true_clears_the_flag():
    assert spec(gpu_zonal_redundancy=True).to_job().template.template.gpu_zonal_redundancy_disabled is False


def test_spec_is_frozen():
    with pytest.raises(AttributeError):
        spec().image = "other"  # type: ignore[misc]


@pytest.mark.parametrize(("value", "vcpu"), [("4", 4.0), ("4.5", 4.5), ("4000m", 4.0), ("20", 20.0)])
def test_parse_cpu(value, vcpu):
    assert parse_cpu(value) == vcpu


@pytest.mark.parametrize(("value", "gib"), [("16Gi", 16.0), ("16384Mi", 16.0), ("1Ti", 1024.0), ("1073741824", 1.0)])
def test_parse_memory(value, gib):
    assert parse_memory_gib(value) == gib


def test_validate_bucket_name_accepts_222_chars_with_dots():
    validate_bucket_name(".".join(["a" * 60] * 3))


class TestTemplateMatches:
    def test_same_spec_matches_server_filled_copy(self):
        desired = spec().to_job()
        deployed = run_v2.Job(desired)
        deployed.name = "projects/p/locations/l/jobs/train-job"
        deployed.generation = 3
        deployed.template.template.service_account = "default@p.iam.gserviceaccount.com"
        deployed.template.template.containers[0].name = ""
        assert template_matches(deployed, desired)

    @pytest.mark.parametrize(
        "overrides",
        [{"image": "other:2"}, {"max_retries": 2}, {"task_timeout": 7200}, {"env": {"B": "2"}},
         {"args": ["--x"]}, {"cpu": "8"}, {"parallelism": 2}, {"labels": {"a": "b"}},
         {"gpu_zonal_redundancy": True}, {"service_account": "x@p.iam.gserviceaccount.com"}],
    )
    def test_any_controlled_difference_is_seen(self, overrides):
        assert not template_matches(spec().to_job(), spec(**overrides).to_job())

    def test_unset_server_defaults_count_as_defaults(self):
        desired = spec(task_timeout=600).to_job()
        deployed = run_v2.Job(desired)
        deployed.template.template._pb.ClearField("max_retries")
        deployed.template.template._pb.ClearField("timeout")
        assert template_matches(deployed, desired)


def test_mount_options_reach_the_volume_and_bad_ones_are_refused_naming_the_parameter():
    job = spec(mount_options=["rename-dir-limit=100", "implicit-dirs", "file-mode=644"]).to_job()
    assert list(job.template.template.volumes[0].gcs.mount_options) == [
        "rename-dir-limit=100", "implicit-dirs", "file-mode=644"]
    assert not template_matches(job, spec().to_job())  # a change of options updates the job
    for bad, says in (("--implicit-dirs", "without the leading '--'"), ("cache-all", "allowed: dir-mode, "),
                      ("rename-dir-limit=x", "non-negative integer"), ("file-mode=9", "octal"),
                      ("implicit-dirs=yes", "=true / =false"), ("x-emulator-strict", "not a Cloud Storage FUSE option")):
        with pytest.raises(ValueError, match=r"^mount_options\[0\]: ") as err:
            spec(mount_options=[bad])
        assert says in str(err.value)
    with pytest.raises(ValueError, match=r"^mount_options\[1\]: 'implicit-dirs' repeats implicit-dirs"):
        spec(mount_options=["implicit-dirs=true", "implicit-dirs"])
    with pytest.raises(ValueError, match="must be a list of strings"):
        spec(mount_options="implicit-dirs")


def test_cpu_only_spec_is_stated_and_asks_for_no_gpu():
    with pytest.warns(UserWarning, match=r"gpu_type=None: a CPU-only job, with no GPU"):
        cpu_only = spec(gpu_type=None, cpu="1", memory="512Mi", task_timeout=24 * 3600)
    job = cpu_only.to_job()
    task = job.template.template
    assert dict(task.containers[0].resources.limits) == {"cpu": "1", "memory": "512Mi"}
    assert "node_selector" not in task and "gpu_zonal_redundancy_disabled" not in task
    assert cpu_only.needs_preview is False
    assert job.launch_stage == launch_stage_pb2.LaunchStage.LAUNCH_STAGE_UNSPECIFIED
    assert not template_matches(job, spec().to_job())  # a GPU job is another template


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"gpu_count": 2}, r"gpu_count=2: a CPU-only job \(gpu_type=None\) takes 0 or 1"),
        ({"gpu_zonal_redundancy": True}, r"gpu_zonal_redundancy=True needs a GPU"),
    ],
)
def test_cpu_only_spec_refuses_gpu_settings(overrides, match):
    with pytest.raises(ValueError, match=match), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        spec(gpu_type=None, **overrides)


def test_validators_name_the_callers_parameter():
    from airflow_gpu_resilience.cloud_run_rules import validate_job_name

    with pytest.raises(ValueError, match=r"^job_name='Bad' is not a valid Cloud Run job name"):
        validate_job_name("Bad", "job_name")
    with pytest.raises(ValueError, match=r"^bucket='ab' is not a valid Cloud Storage bucket name"):
        validate_bucket_name("ab", "bucket")
