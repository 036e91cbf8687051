"""Distribution: the one place a tf.distribute strategy is chosen (`strategy`), cluster specs (`cluster`),
starting workers (`launch`), and what keeps a cluster run honest (`watchdog`, `preemption`,
`replica_state`)."""
