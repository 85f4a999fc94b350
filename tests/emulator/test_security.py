"""What the emulator accepts from whom: the real servers (Admin API and GCS emulator), the real
Google clients, and raw requests shaped as a browser page would send them."""

from __future__ import annotations

import http.client
import json
import urllib.parse

import pytest
from google.api_core import exceptions as gexc
from google.cloud import run_v2

from cloud_run_emulator import guards
from cloud_run_emulator.runtime import rewrite

from .conftest import PARENT, create, make_job, poll_execution


def raw(endpoint: str, method: str, path: str, body: bytes = b"", headers=None) -> tuple:
    """Send one request with exactly ``headers`` (``Host`` too, when given); ``(status, body)``."""
    url = urllib.parse.urlsplit(endpoint)
    headers = dict(headers or {})
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    try:
        conn.putrequest(method, path, skip_host="Host" in headers, skip_accept_encoding=True)
        for key, value in headers.items():
            conn.putheader(key, value)
        if body or method not in ("GET", "HEAD"):
            conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body or None)
        answer = conn.getresponse()
        return answer.status, answer.read()
    finally:
        conn.close()


def error_of(data: bytes) -> dict:
    return json.loads(data)["error"]


def job_body(image: str = "local/exit:latest") -> bytes:
    return json.dumps({"template": {"template": {"containers": [{"image": image}]}}}).encode()


def test_every_port_of_the_emulator_listens_on_loopback_only(emulator):
    """REST, gRPC (``CLOUD_RUN_EMULATOR_HOST``), the GCS emulator and ``--google-endpoint``'s TLS
    port and proxy: every listening socket of the emulator's process is on 127.0.0.1, so no other
    machine reaches any of them."""
    import psutil

    listening = {(c.laddr.ip, c.laddr.port) for c in psutil.Process(emulator.pid).net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN}
    ports = {int(e.rsplit(":", 1)[1]) for e in (emulator.endpoint, emulator.grpc_endpoint, emulator.gcs_endpoint)}
    assert ports <= {port for _, port in listening} and len(listening) >= 5, listening  # 3 + the TLS port and proxy
    # gRPC's sockets are IPv6 ones bound to the v4-mapped 127.0.0.1: loopback all the same
    assert {ip.removeprefix("::ffff:") for ip, _ in listening} == {"127.0.0.1"}, listening


# --- item 4: requests a web page could send --------------------------------------------------

def test_a_page_cannot_create_a_job_with_a_simple_cross_site_post(emulator, jobs, job_id):
    """A ``text/plain`` POST with a foreign Origin and Host is what a page's ``fetch(..., {mode:
    "no-cors"})`` sends after DNS rebinding, with no CORS preflight: refused, nothing created."""
    status, data = raw(emulator.endpoint, "POST", f"/v2/{PARENT}/jobs?jobId={job_id}", job_body(),
                       {"Host": "evil.example:8123", "Origin": "http://evil.example:8123",
                        "Content-Type": "text/plain;charset=UTF-8"})
    assert status == 403 and error_of(data)["status"] == "PERMISSION_DENIED"
    with pytest.raises(gexc.NotFound):
        jobs.get_job(name=f"{PARENT}/jobs/{job_id}")


@pytest.mark.parametrize(("headers", "code", "named"), [
    ({"Content-Type": "text/plain"}, 415, "Content-Type"),  # a form or no-cors fetch body
    ({"Content-Type": "application/x-www-form-urlencoded"}, 415, "Content-Type"),
    ({}, 415, "Content-Type"),  # no type at all
    ({"Content-Type": "application/json", "Origin": "http://evil.example"}, 403, "Origin"),
    ({"Content-Type": "application/json", "Origin": "null"}, 403, "Origin"),  # sandboxed frame
    ({"Content-Type": "application/json", "Host": "evil.example"}, 403, "Host"),  # DNS rebinding
    ({"Content-Type": "application/json", "Host": "127.0.0.1.evil.example"}, 403, "Host"),
    ({"Content-Type": "application/json", "Host": "localhost.evil.example:80"}, 403, "Host"),
    ({"Content-Type": "application/json", "Host": "0.0.0.0"}, 403, "Host"),
    ({"Content-Type": "application/json", "Sec-Fetch-Site": "cross-site"}, 403, "Sec-Fetch-Site"),
])
def test_each_check_refuses_a_run_job(emulator, jobs, executions, job_id, headers, code, named):
    job = create(jobs, job_id, make_job("local/exit:latest"))
    status, data = raw(emulator.endpoint, "POST", f"/v2/{job.name}:run", b"{}", headers)
    assert status == code and named in error_of(data)["message"], data
    assert list(executions.list_executions(parent=job.name)) == []  # nothing ran


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.1:{port}", "127.8.9.10:{port}", "localhost",
                                  "LocalHost:{port}", "[::1]", "[::1]:{port}"])
def test_loopback_host_values_are_served(emulator, host):
    port = urllib.parse.urlsplit(emulator.endpoint).port
    host = host.format(port=port)
    status, data = raw(emulator.endpoint, "POST", "/_emulator/transitions", b"{}",
                       {"Host": host, "Content-Type": "application/json; charset=utf-8"})
    assert status == 200 and "graceSeconds" in json.loads(data)
    status, _ = raw(emulator.endpoint, "POST", "/_emulator/transitions", b"{}",
                    {"Host": host, "Content-Type": "application/json", "Origin": f"http://{host}"})
    assert status == 200  # the emulator's own origin


def test_admin_routes_refuse_cross_site_requests(emulator):
    for path in ("/_emulator/transitions", "/_emulator/faults", "/_emulator/preempt", "/_emulator/reset"):
        status, data = raw(emulator.endpoint, "POST", path, b"{}", {"Content-Type": "text/plain"})
        assert status == 415 and error_of(data)["status"] == "INVALID_ARGUMENT", path
    status, _ = raw(emulator.endpoint, "GET", "/_emulator/health", headers={"Host": "attacker.example"})
    assert status == 403  # a rebound page cannot read answers either


def test_a_browser_may_open_a_log_link(emulator, jobs, executions, job_id):
    """The logs link Airflow shows is a top-level navigation: GET, no Origin, Sec-Fetch-Site
    cross-site (from Airflow's own page): still served."""
    job = create(jobs, job_id, make_job("local/exit:latest"))
    execution = poll_execution(executions, jobs.run_job(name=job.name).metadata.name)
    path = urllib.parse.urlsplit(execution.log_uri).path
    status, data = raw(emulator.endpoint, "GET", path, headers={"Sec-Fetch-Site": "cross-site",
                                                               "Sec-Fetch-Mode": "navigate"})
    assert status == 200 and b"exiting 0" in data


def test_gcs_emulator_refuses_page_requests_and_serves_the_storage_client(emulator, storage_client, bucket):
    blob = bucket.blob("plain.txt")
    blob.upload_from_string(b"hello", content_type="text/plain")  # the client's multipart upload
    assert blob.download_as_bytes() == b"hello"
    gcs = emulator.gcs_endpoint
    status, data = raw(gcs, "GET", f"/download/storage/v1/b/{bucket.name}/o/plain.txt?alt=media",
                       headers={"Host": "evil.example:9023"})
    assert status == 403 and b"hello" not in data and error_of(data)["status"] == "PERMISSION_DENIED"
    status, data = raw(gcs, "GET", f"/download/storage/v1/b/{bucket.name}/o/plain.txt?alt=media",
                       headers={"Origin": "http://evil.example"})
    assert status == 403 and b"hello" not in data
    upload = f"/upload/storage/v1/b/{bucket.name}/o?uploadType=media&name=planted.txt"
    status, _ = raw(gcs, "POST", upload, b"planted", {"Content-Type": "text/plain"})
    assert status == 415
    status, _ = raw(gcs, "GET", "/wipe")  # an <img src> could send this
    assert status == 403
    assert bucket.blob("plain.txt").exists() and not bucket.blob("planted.txt").exists()


@pytest.mark.parametrize("path", ["/wipe;x", "/wipe;", "/wipe/", "/wipe?x=1", "/wipe;x?y=1"])
def test_no_spelling_of_wipe_gets_past_the_guard(emulator, bucket, path):
    """The storage's router drops ``;params`` and a trailing slash before it matches ``/wipe``;
    the guard reads the path the same way, so an ``<img src=".../wipe;x">`` deletes nothing."""
    bucket.blob("kept.txt").upload_from_string(b"kept")
    status, _ = raw(emulator.gcs_endpoint, "GET", path, headers={"Sec-Fetch-Site": "cross-site"})
    assert status in (403, 404)
    assert bucket.blob("kept.txt").exists()


@pytest.mark.parametrize("path", ["/storage/v1/b;x?project=test-project", "/b;x?project=test-project",
                                  "/storage/v1/b/?project=test-project"])
def test_bucket_names_are_checked_on_every_spelling_of_the_insert(emulator, storage_client, path):
    before = sorted(p.name for p in emulator.bucket_dir("x").parent.iterdir())
    status, data = raw(emulator.gcs_endpoint, "POST", path, json.dumps({"name": "a/b/c"}).encode(),
                       {"Content-Type": "application/json"})
    assert status == 400 and error_of(data)["status"] == "INVALID_ARGUMENT"
    assert sorted(p.name for p in emulator.bucket_dir("x").parent.iterdir()) == before
    assert [b.name for b in storage_client.list_buckets()] is not None  # the server still answers


def test_uploads_never_write_through_a_link_out_of_the_bucket(emulator, bucket, tmp_path):
    """A task may leave symbolic links in a mounted bucket; an upload through one (to a folder or
    a file outside) is refused and the target is untouched."""
    outside = tmp_path / "outside"
    outside.mkdir()
    secret = outside / "secret.txt"
    secret.write_bytes(b"secret")
    folder = emulator.bucket_dir(bucket.name)
    (folder / "dirlink").symlink_to(outside, target_is_directory=True)
    (folder / "filelink").symlink_to(secret)
    for name, data in (("dirlink/planted.txt", b"planted"), ("filelink", b"OVERWRITTEN")):
        upload = f"/upload/storage/v1/b/{bucket.name}/o?uploadType=media&name={urllib.parse.quote(name, safe='')}"
        status, answer = raw(emulator.gcs_endpoint, "POST", upload, data,
                             {"Content-Type": "application/octet-stream"})
        assert status == 403 and error_of(answer)["status"] == "PERMISSION_DENIED", (name, answer)
    assert sorted(p.name for p in outside.iterdir()) == ["secret.txt"]
    assert secret.read_bytes() == b"secret"
    bucket.blob("inside/fine.txt").upload_from_string(b"fine")  # ordinary uploads still work
    assert bucket.blob("inside/fine.txt").download_as_bytes() == b"fine"


# --- item 5: limits ---------------------------------------------------------------------------

def test_a_50_mb_create_job_is_refused_with_413(jobs, job_id):
    big = make_job("local/exit:latest", env={"BIG": "x" * (50 << 20)})
    with pytest.raises(gexc.GoogleAPICallError) as err:
        jobs.create_job(parent=PARENT, job=big, job_id=job_id, timeout=120).result(timeout=30)
    assert err.value.code == 413 and "exceeds the limit" in err.value.message, repr(err.value)
    with pytest.raises(gexc.NotFound):
        jobs.get_job(name=f"{PARENT}/jobs/{job_id}")


def test_a_chunked_body_over_the_limit_is_refused(emulator, job_id):
    url = urllib.parse.urlsplit(emulator.endpoint)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    chunks = (b"x" * (1 << 20) for _ in range(8))  # 8 MiB, no Content-Length
    conn.request("POST", f"/v2/{PARENT}/jobs?jobId={job_id}", body=chunks,
                 headers={"Content-Type": "application/json"}, encode_chunked=True)
    answer = conn.getresponse()
    assert answer.status == 413 and error_of(answer.read())["status"] == "RESOURCE_EXHAUSTED"
    conn.close()


@pytest.mark.parametrize("path", ["/_emulator/faults", "/_emulator/transitions", "/_emulator/preempt",
                                  "/_emulator/reset", "/_emulator/preemptions/schedule",
                                  f"/v2/{PARENT}/jobs?jobId=deep", f"/v2/{PARENT}/operations/x:wait"])
def test_deeply_nested_json_is_invalid_argument(emulator, path):
    deep = b"[" * 100_000 + b"]" * 100_000
    status, data = raw(emulator.endpoint, "POST", path, deep, {"Content-Type": "application/json"})
    assert status == 400 and error_of(data)["status"] == "INVALID_ARGUMENT", data


@pytest.mark.parametrize(("parent", "named"), [
    ("projects/../locations/us-central1", "project '..'"),
    ("projects/test-project/locations/..", "location '..'"),
])
def test_dot_dot_project_and_location_are_invalid_argument(emulator, job_id, parent, named):
    """google-api-core refuses ``..`` segments itself; a raw request reaches the emulator."""
    status, data = raw(emulator.endpoint, "POST", f"/v2/{parent}/jobs?jobId={job_id}", job_body(),
                       {"Content-Type": "application/json"})
    assert status == 400 and error_of(data)["status"] == "INVALID_ARGUMENT"
    assert error_of(data)["message"].startswith("parent: ") and named in error_of(data)["message"]
    status, data = raw(emulator.endpoint, "GET", f"/v2/{parent}/jobs/{job_id}")
    assert status == 400 and error_of(data)["message"].startswith("name: ")


@pytest.mark.parametrize(("parent", "named"), [
    ("projects/p/locations/us-central1", "project 'p'"),  # too short
    ("projects/Test-Project/locations/us-central1", "project 'Test-Project'"),
    ("projects/test-project-/locations/us-central1", "project 'test-project-'"),
    ("projects/test-project/locations/us_central1", "location 'us_central1'"),
    ("projects/test-project/locations/-", "location '-'"),
])
def test_bad_project_and_location_ids_are_invalid_argument(jobs, job_id, parent, named):
    with pytest.raises(gexc.BadRequest) as err:
        jobs.create_job(parent=parent, job=make_job("local/exit:latest"), job_id=job_id)
    assert "parent: " in err.value.message and named in err.value.message
    with pytest.raises(gexc.BadRequest) as err:
        jobs.get_job(name=f"{parent}/jobs/{job_id}")
    assert "name: " in err.value.message and named in err.value.message


def test_project_numbers_and_regions_are_accepted(jobs, job_id):
    parent = "projects/123456789012/locations/europe-west4"
    job = jobs.create_job(parent=parent, job=make_job("local/exit:latest"), job_id=job_id).result(timeout=10)
    assert job.name == f"{parent}/jobs/{job_id}"


@pytest.mark.parametrize("name", ["..", ".", "a/b", "../escape", "ab", "-ab", "ab-", "Ab-c", "a" * 64,
                                  "192.168.1.1", "goog-x", "my-google-bucket", "a..b", "_resumable", ".meta"])
def test_invalid_bucket_names_are_refused_and_nothing_is_created(emulator, storage_client, name):
    before = sorted(p.name for p in emulator.bucket_dir("x").parent.iterdir())
    status, data = raw(emulator.gcs_endpoint, "POST", "/storage/v1/b?project=test-project",
                       json.dumps({"name": name}).encode(), {"Content-Type": "application/json"})
    assert status == 400 and error_of(data)["status"] == "INVALID_ARGUMENT" and "bucket name" in error_of(data)["message"]
    assert sorted(p.name for p in emulator.bucket_dir("x").parent.iterdir()) == before
    assert name not in [b.name for b in storage_client.list_buckets()]


def test_valid_bucket_names_still_work(storage_client):
    created = storage_client.create_bucket("ckpt.dotted_name-1")
    assert storage_client.get_bucket("ckpt.dotted_name-1").name == created.name


# --- item 3: paths derived from requests stay inside the data folder -------------------------

def _with_mount(bucket: str, sub_path: str = "", mount_path: str = "/checkpoints", **kwargs) -> run_v2.Job:
    job = make_job("local/exit:latest", bucket=bucket, **kwargs)
    mount = job.template.template.containers[0].volume_mounts[0]
    mount.sub_path, mount.mount_path = sub_path, mount_path
    return job


@pytest.mark.parametrize(("sub_path", "mount_path", "field"), [
    ("..", "/checkpoints", "volume_mounts[0].sub_path"),
    ("../../outside", "/checkpoints", "volume_mounts[0].sub_path"),
    ("run/../../outside", "/checkpoints", "volume_mounts[0].sub_path"),
    ("/etc", "/checkpoints", "volume_mounts[0].sub_path"),
    ("", "checkpoints", "volume_mounts[0].mount_path"),  # relative
    ("", "/", "volume_mounts[0].mount_path"),
    ("", "/checkpoints/../x", "volume_mounts[0].mount_path"),
    ("", "/c:d", "volume_mounts[0].mount_path"),
    ("", "", "volume_mounts[0].mount_path"),
])
def test_volume_paths_that_leave_the_volume_are_invalid_argument(jobs, bucket, job_id, sub_path, mount_path, field):
    with pytest.raises(gexc.BadRequest) as err:
        jobs.create_job(parent=PARENT, job=_with_mount(bucket.name, sub_path, mount_path), job_id=job_id)
    assert f"containers[0].{field}" in err.value.message
    with pytest.raises(gexc.NotFound):
        jobs.get_job(name=f"{PARENT}/jobs/{job_id}")


@pytest.mark.parametrize(("env", "args", "field"), [
    ({"OUT": "/checkpoints/../../x"}, None, "containers[0].env[0].value"),
    ({"OUT": "/checkpoints/.."}, None, "containers[0].env[0].value"),
    ({}, ["--out=/checkpoints/a/../../../x"], "containers[0].args[0]"),
    ({}, ["ok", "/checkpoints/../.."], "containers[0].args[1]"),
])
def test_values_under_a_mount_that_leave_it_are_invalid_argument(jobs, bucket, job_id, env, args, field):
    with pytest.raises(gexc.BadRequest) as err:
        jobs.create_job(parent=PARENT, job=_with_mount(bucket.name, env=env, args=args), job_id=job_id)
    assert field in err.value.message and "leads out of the volume" in err.value.message


def test_run_overrides_that_leave_a_volume_are_invalid_argument(jobs, executions, bucket, job_id):
    job = create(jobs, job_id, _with_mount(bucket.name))
    overrides = run_v2.RunJobRequest.Overrides(container_overrides=[
        run_v2.RunJobRequest.Overrides.ContainerOverride(env=[run_v2.EnvVar(name="OUT", value="/checkpoints/../../x")])])
    with pytest.raises(gexc.BadRequest) as err:
        jobs.run_job(request=run_v2.RunJobRequest(name=job.name, overrides=overrides))
    assert "env[0].value" in err.value.message
    assert list(executions.list_executions(parent=job.name)) == []


def test_paths_that_stay_inside_the_volume_are_rewritten_inside_it(jobs, executions, emulator, bucket, job_id):
    job = create(jobs, job_id, _with_mount(bucket.name, sub_path="run-1", env={"OUT": "/checkpoints/a/../out"}))
    execution = poll_execution(executions, jobs.run_job(name=job.name).metadata.name)
    assert execution.succeeded_count == 1
    assert (emulator.bucket_dir(bucket.name) / "run-1" / "out" / "task-0" / "attempt-0.json").is_file()


def test_rewrite_never_leaves_the_volume_folder(tmp_path):
    mounts = [("/checkpoints", tmp_path / "bucket")]
    assert rewrite("/checkpoints/a/../b", mounts) == f"{tmp_path / 'bucket'}/a/../b"
    assert rewrite("--out=/checkpoints", mounts) == f"--out={tmp_path / 'bucket'}"
    assert rewrite("/elsewhere/../x", mounts) == "/elsewhere/../x"  # not under a mount: unchanged
    for value in ("/checkpoints/../../x", "--out=/checkpoints/..", "/checkpoints/a/../../b"):
        with pytest.raises(guards.PathEscape):
            rewrite(value, mounts)


def test_log_route_stays_in_the_log_folder(emulator):
    planted = emulator.data_dir / "task0-planted.log"  # in the data folder, outside logs/
    planted.write_text("not a log of any execution")
    try:
        for name in (f"{PARENT}/jobs/j/executions/..", f"{PARENT}/jobs/j/executions/../tasks/..-task0",
                     f"{PARENT}/jobs/j/executions/.", "..", f"{PARENT}/jobs/j/executions/e/tasks/e-task*"):
            status, data = raw(emulator.endpoint, "GET", "/_emulator/logs/" + urllib.parse.quote(name, safe="/"))
            assert status in (400, 404) and b"not a log" not in data, (name, data)
    finally:
        planted.unlink()


@pytest.mark.parametrize("host", ["127.0.0.1", "127.255.0.1:80", "localhost", "LOCALHOST:1", "[::1]", "[::1]:8123"])
def test_loopback_host_accepts(host):
    assert guards.loopback_host(host)


@pytest.mark.parametrize("host", ["", None, "evil.example", "127.0.0.1.nip.io", "localhost.example", "0.0.0.0",
                                  "10.0.0.1", "[::2]", "[::ffff:8.8.8.8]", "127.1", "127.0.0.1:8123:1",
                                  "user@127.0.0.1", "127.0.0.1/x", "[::1", "localhost:port"])
def test_loopback_host_refuses(host):
    assert not guards.loopback_host(host)


def test_object_names_with_dot_dot_are_a_400_not_a_dropped_connection(bucket):
    with pytest.raises(gexc.BadRequest) as err:
        bucket.blob("run/../../escape").upload_from_string(b"x")
    assert "invalid object name" in err.value.message
    assert not bucket.blob("escape").exists()
