"""Datasets and loaders: raw arrays (sources), classification datasets, transforms, samplers."""
