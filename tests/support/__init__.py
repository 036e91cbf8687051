"""Test (and benchmark) support: realistic image trees, a local GCS server, a local S3 server, a fixed-batch
trainer for exactness tests."""
