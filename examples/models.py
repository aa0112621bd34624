"""Example models for gradwatch, trained on synthetic data made on the spot.

They live in the package (:mod:`gradwatch.cli.demo_models`) so that the ``gradwatch demo`` command ships them; this
module re-exports them for the examples and the benchmarks. See that module for what each model is and which bug it
plants.
"""

from gradwatch.cli.demo_models import (
    CustomNormClassifier,
    DetachedPenaltyClassifier,
    HealthyClassifier,
    RMSNorm,
    RMSNormFunction,
    ScaledGradClassifier,
    synthetic_classification,
    synthetic_loader,
)

__all__ = [
    "CustomNormClassifier",
    "DetachedPenaltyClassifier",
    "HealthyClassifier",
    "RMSNorm",
    "RMSNormFunction",
    "ScaledGradClassifier",
    "synthetic_classification",
    "synthetic_loader",
]
