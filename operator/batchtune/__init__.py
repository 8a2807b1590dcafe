"""batchtune: find and apply the best vLLM batching settings for an inference Deployment."""

__version__ = "0.1.0"

API_GROUP = "batchtune.io"
API_VERSION = "v1alpha1"
KIND = "BatchTuning"
PLURAL = "batchtunings"
