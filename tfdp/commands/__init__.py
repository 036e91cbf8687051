"""The commands other than `train`, each in its own module: `evaluate`, `export`, `predict`, `report`,
`benchmark` (`tfdp.cli` dispatches; `train` is `tfdp.train.trainer`)."""
