"""Ready-made federated models."""

from .glmm import logistic_glmm, normal_hierarchical
from .split_nn import predict_split_nn, split_nn, split_nn_model

__all__ = ["logistic_glmm", "normal_hierarchical", "predict_split_nn", "split_nn", "split_nn_model"]
