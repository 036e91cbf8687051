"""The training run: what every command builds from the config (`task`: `ClassificationTask` and the run's
`Plan`), one run held (`run`) and fitted (`trainer`) with its callbacks, and what sizes it (`global_batch`,
`input_streams`)."""
