"""The library the Ray cluster runs behind jobs/: one package a wing, over a small core.

core/    config, storage, errors, logs, the cluster-capacity wait, figures, fault points,
         and Ray's private imports (ray_internals)
data/    the stored dataset (Parquet shards + manifest), image sources and decoding, preprocessing
train/   the TorchTrainer driver, the worker loop, its two input paths, the optimizer and schedule
infer/   batch inference on Ray Data: inputs, the predictor, predictions on storage
model/   the network, its checkpoints, a training run's record, the device-and-precision policy
tracking/  the runs in MLflow, when a job has a tracking URI; the registered model
serve/   online inference: the Ray Serve application of configs/serve.yaml
export/  a checkpoint to ONNX and torch.export, checked against PyTorch before it is written

Wings import the core and model/, never each other (infer/ imports no training code), with one
exception: serve/ reads a registered model version through tracking/'s entry, imported only
for a `models:/` model. A new capability gets a wing of its own beside these; a new
architecture goes into model/.
"""
