"""Ready-made federated models."""

from .glmm import logistic_glmm, normal_hierarchical
from .linear import hm2_regression, inclusion, variable_selection
from .neural import bnn, bnn_predict, fedpop_bnn, hierarchical_bnn, multinomial_regression
from .split_nn import predict_split_nn, split_nn, split_nn_model

__all__ = [
    "bnn",
    "bnn_predict",
    "fedpop_bnn",
    "hierarchical_bnn",
    "multinomial_regression",
    "hm2_regression",
    "inclusion",
    "logistic_glmm",
    "normal_hierarchical",
    "predict_split_nn",
    "split_nn",
    "split_nn_model",
    "variable_selection",
]
