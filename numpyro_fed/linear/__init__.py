"""Yue et al.'s (2022) linear models: HM1 (a learned device covariance, Algorithm 1)."""

from .hm1_inference import HM1, UnconvergedWarning

__all__ = ["HM1", "UnconvergedWarning"]
