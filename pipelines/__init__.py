"""Offline data jobs: converting raw ImageNet trees to TFRecord shards."""
