"""The tf.data service: the trainer's side (`client`: the pipeline sent to the service, with TensorFlow) and the
service's own processes (`servers`: the dispatcher and workers, and the reachability checks a trainer runs before
TensorFlow loads). This package imports neither, so `tfdp.data.service.servers` stays free of TensorFlow."""
