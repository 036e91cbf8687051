"""Offline data jobs: building the demo dataset, converting raw trees to TFRecords."""
