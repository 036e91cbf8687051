"""Process start-up, before and around TensorFlow: the memory allocator, TensorFlow's settings and logging,
and the console (what reaches the terminal, one line per fault). Imported first by every command."""
