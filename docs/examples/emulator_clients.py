"""The unmodified Google clients against the emulator, started from Python.

The "Emulator" page shows the parts between the markers; ``tests/system/test_docs_examples.py``
runs this file as a script: it starts the emulator in a temporary folder, creates a bucket and
lists jobs over REST and over gRPC, and prints what it found.
"""

from __future__ import annotations

import tempfile

# [START howto_emulator_process]
from cloud_run_emulator.process import EmulatorProcess

with tempfile.TemporaryDirectory() as data_dir, EmulatorProcess(data_dir) as emulator:
    print("REST:", emulator.endpoint, "gRPC:", emulator.grpc_endpoint, "GCS:", emulator.gcs_endpoint)
    # [END howto_emulator_process]
    # [START howto_emulator_rest_client]
    from google.api_core.client_options import ClientOptions
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import run_v2

    jobs = run_v2.JobsClient(credentials=AnonymousCredentials(), transport="rest",
                             client_options=ClientOptions(api_endpoint=emulator.endpoint))
    print("jobs over REST:", [job.name for job in jobs.list_jobs(parent="projects/my-project/locations/us-central1")])
    # [END howto_emulator_rest_client]
    # [START howto_emulator_grpc_client]
    import grpc
    from google.cloud.run_v2.services.jobs.transports import JobsGrpcTransport

    channel = grpc.insecure_channel(emulator.grpc_endpoint)
    jobs = run_v2.JobsClient(transport=JobsGrpcTransport(channel=channel))
    print("jobs over gRPC:", [job.name for job in jobs.list_jobs(parent="projects/my-project/locations/us-central1")])
    # [END howto_emulator_grpc_client]
    # [START howto_emulator_storage_client]
    from google.cloud import storage

    buckets = storage.Client(project="my-project", credentials=AnonymousCredentials(),
                             client_options={"api_endpoint": emulator.gcs_endpoint})
    buckets.create_bucket("my-checkpoint-bucket")
    print("buckets:", [bucket.name for bucket in buckets.list_buckets()])
    # [END howto_emulator_storage_client]
    channel.close()
