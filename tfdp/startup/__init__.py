"""Process start-up, before and around TensorFlow: the memory allocator, TensorFlow's settings and logging,
the console (what reaches the terminal, one line per fault), and the memory the process may still take. Imported
first by every command."""
