"""The training run: the model, data and optimizer assembled for a command (`assembly`), one run held
(`run`) and fitted (`trainer`) with its callbacks; what sizes it (`global_batch`, `accumulation`,
`image_sizes`, `input_streams`) and fine-tuning's phases (`finetune`)."""
