"""A real S3 server on loopback (PyPI `moto[server]`, run as its own process) for tests and local trials.

s3fs (through botocore) finds it the way it finds any S3-compatible store:
AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY and a region from
the environment. The server checks credentials like S3 does: the bucket is
made and the IAM users are created before request authentication is switched
on, so afterwards an unknown key is refused and a user without a policy is
denied. The user's own ~/.aws files and AWS_* variables are masked while the
server runs and restored when it stops.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import urllib.request

from support.servers import server_process

REGION = "us-east-1"
# Whatever botocore would otherwise read instead of (or on top of) what the server sets.
MASKED = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
          "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_DEFAULT_REGION", "AWS_REGION",
          "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE", "AWS_EC2_METADATA_DISABLED")
ALLOW_S3 = json.dumps({"Version": "2012-10-17",
                       "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]})
READ_S3 = json.dumps({"Version": "2012-10-17",
                      "Statement": [{"Effect": "Allow", "Action": ["s3:Get*", "s3:List*"], "Resource": "*"}]})


@dataclasses.dataclass(frozen=True)
class S3Server:
    endpoint: str     # http://127.0.0.1:<port>
    bucket: str       # s3://<bucket>, made empty at start
    env: dict         # what points botocore at the server as the user allowed to use the bucket
    outsider: dict    # the credentials of a real user with no permission at all
    reader: dict      # the credentials of a real user allowed to read and list, not to write

    def client_env(self, **credentials: str) -> dict:
        """`env` with other credentials (e.g. AWS_SECRET_ACCESS_KEY=wrong), for a subprocess."""
        return {**self.env, **credentials}


@contextlib.contextmanager
def s3_server(bucket: str = "tfdp-test", startup_seconds: float = 60):
    """Starts moto_server on a free loopback port with `bucket`; sets the environment; yields an `S3Server`."""
    command = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", "{port}"]
    import s3fs
    saved = dict(os.environ)
    with server_process(command, "the S3 server (moto)", startup_seconds, MASKED) as port:
        endpoint = f"http://127.0.0.1:{port}"
        for key in MASKED:
            os.environ.pop(key, None)
        base = {"AWS_ENDPOINT_URL": endpoint, "AWS_DEFAULT_REGION": REGION, "AWS_CONFIG_FILE": os.devnull,
                "AWS_SHARED_CREDENTIALS_FILE": os.devnull, "AWS_EC2_METADATA_DISABLED": "true"}
        member, outsider, reader = _set_up(endpoint, bucket)
        os.environ.update(base, **member)
        # fsspec keeps one S3FileSystem per set of arguments, not per environment: one made for an earlier
        # server in this process would still talk to that server's (closed) port.
        s3fs.S3FileSystem.clear_instance_cache()
        try:
            yield S3Server(endpoint, f"s3://{bucket}", {**base, **member}, outsider, reader)
        finally:
            # Only what this server set is put back: a server started meanwhile (the GCS emulator of a
            # session fixture) keeps its own variables.
            for key in {*MASKED, *base, *member}:
                if key in saved:
                    os.environ[key] = saved[key]
                else:
                    os.environ.pop(key, None)
            s3fs.S3FileSystem.clear_instance_cache()


def _set_up(endpoint: str, bucket: str) -> tuple[dict, dict, dict]:
    """Makes the bucket and three IAM users (one allowed s3:*, one nothing, one reading), then turns
    authentication on."""
    import boto3

    anyone = {"endpoint_url": endpoint, "region_name": REGION, "aws_access_key_id": "setup",
              "aws_secret_access_key": "setup"}
    boto3.client("s3", **anyone).create_bucket(Bucket=bucket)
    iam = boto3.client("iam", **anyone)
    keys = []
    for user, policy in (("tfdp", ALLOW_S3), ("outsider", None), ("reader", READ_S3)):
        iam.create_user(UserName=user)
        if policy:
            iam.put_user_policy(UserName=user, PolicyName="s3", PolicyDocument=policy)
        key = iam.create_access_key(UserName=user)["AccessKey"]
        keys.append({"AWS_ACCESS_KEY_ID": key["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"]})
    # Every request from now on is authenticated and authorised (moto counts from 0 again).
    request = urllib.request.Request(f"{endpoint}/moto-api/reset-auth", data=b"0", method="POST",
                                     headers={"Content-Type": "text/plain"})
    urllib.request.urlopen(request, timeout=10).close()
    return keys[0], keys[1], keys[2]
