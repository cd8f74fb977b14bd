# The image every pod of scripts/launch_gke.py runs (docs/clusters.md, "GKE"): this repo at /app on its pinned
# requirements. The base is the JAX AI image users pull for TPUs (GPUs: pass its GPU twin), for the Python and system
# libraries the TPU runtime and CUDA expect; the pins below then install the jax this repo is tested with over it.
#   TPU: docker build -t IMAGE .
#   GPU: docker build --build-arg ACCELERATOR=cuda12 \
#          --build-arg BASE_IMAGE=us-central1-docker.pkg.dev/deeplearning-images/jax-ai-image/gpu:jax0.5.1-cuda_dl25.02-rev1 -t IMAGE .
ARG BASE_IMAGE=us-docker.pkg.dev/cloud-tpu-images/jax-ai-image/tpu:jax0.9.0-rev1
FROM ${BASE_IMAGE}
# jax's extra for the accelerator runtime, at requirements.txt's jax version: tpu (libtpu) or cuda12.
ARG ACCELERATOR=tpu
WORKDIR /app
# The requirement files first: a change to the code alone reuses this layer.
COPY requirements.txt requirements-gcs.txt ./
RUN JAX_VERSION=$(sed -n 's/^jax==//p' requirements.txt) && \
    python -m pip install --no-cache-dir -r requirements.txt -r requirements-gcs.txt "jax[${ACCELERATOR}]==${JAX_VERSION}"
COPY . .
# The build fails here, not on the cluster, when the launcher cannot import.
RUN python -c "import launch, trainer.run.loop"
ENV PYTHONUNBUFFERED=1
# No ENTRYPOINT: the JobSet gives each pod its command (`python launch.py ...`, parallel/jobset.py).
