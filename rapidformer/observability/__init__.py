"""What a run tells: the metrics sink and the trackers behind it (TensorBoard, W&B, MLflow),
gradient-norm spikes, model FLOPs and MFU, the run record (environment.json)."""
