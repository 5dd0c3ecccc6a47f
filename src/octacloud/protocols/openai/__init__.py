"""OpenAI's API: request checking, errors in its shape, and the replica's generative endpoints."""
