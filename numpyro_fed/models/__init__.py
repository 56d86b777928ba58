"""Ready-made federated models."""

from .glmm import logistic_glmm, normal_hierarchical

__all__ = ["logistic_glmm", "normal_hierarchical"]
