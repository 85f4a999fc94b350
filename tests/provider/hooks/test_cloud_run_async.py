"""CloudRunGpuAsyncHook on both transports: the same answers as the sync hook; on gRPC every
request is a native ``grpc.aio`` call (no worker thread per request), over REST each one runs
the sync client in a thread (its async clients have no REST transport).

Threads are counted at the event loop's default executor, which ``asyncio.to_thread`` uses.
"""

from __future__ import annotations

import asyncio
import concurrent.futures

from airflow_gpu_resilience.hooks.cloud_run import CloudRunGpuHook
from airflow_gpu_resilience.hooks.cloud_run_async import CloudRunGpuAsyncHook
from airflow_gpu_resilience.job_spec import GpuJobSpec
from tests.provider.conftest import BUCKET, PROJECT, REGION, STUB_IMAGE

CALLS = 10


class CountingExecutor(concurrent.futures.ThreadPoolExecutor):
    """The loop's default executor, counting the work handed to it."""

    def __init__(self) -> None:
        super().__init__(max_workers=4)
        self.submitted = 0

    def submit(self, *args, **kwargs):
        self.submitted += 1
        return super().submit(*args, **kwargs)


def test_reads_match_the_sync_hook_and_are_native_on_grpc(gcp_conn, job_name, request):
    sync = CloudRunGpuHook(gcp_conn_id=gcp_conn)
    sync.create_job(job_name=job_name, job=GpuJobSpec(name=job_name, image=STUB_IMAGE, checkpoint_bucket=BUCKET),
                    region=REGION)
    _, execution = sync.run_job(job_name=job_name, region=REGION)
    final = sync.wait_for_execution(execution, poll_interval=0.1, timeout=60)
    executor = CountingExecutor()

    async def reads():
        asyncio.get_running_loop().set_default_executor(executor)
        hook = CloudRunGpuAsyncHook(gcp_conn_id=gcp_conn)
        try:
            first = await hook.get_execution(execution)  # makes the clients (credentials: one thread)
            before = executor.submitted
            for _ in range(CALLS):
                got = await hook.get_execution(execution)
                tasks = await hook.list_tasks(execution)
                page, _token = await hook.list_executions_page(PROJECT, REGION, job_name)
            return hook.native, executor.submitted - before, first, got, tasks, page
        finally:
            await hook.close()

    native, threads, first, got, tasks, page = asyncio.run(reads())
    executor.shutdown()
    assert first.name == got.name == execution and got.completion_time == final.completion_time
    assert [t.name for t in tasks] == [t.name for t in sync.list_tasks(execution=execution)]
    assert [e.name for e in page] == [execution]
    if "grpc" in request.node.callspec.id:
        assert native and threads == 0, f"{threads} thread hand-offs for {3 * CALLS} gRPC requests"
    else:
        assert not native and threads >= 3 * CALLS
