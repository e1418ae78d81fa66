# Written by imagefactory for cell py3.11-cpu-mkl-conda; sourced by login shells (/etc/profile.d/) and by
# Apptainer/Singularity on every action (/.singularity.d/env/), which skip the ENTRYPOINT.
# The image's launch settings, in POSIX sh: a value already set (docker run -e, a pod's env:,
# the host's environment under Apptainer or ch-run) wins. Python gets the same settings from the
# imagefactory_launch hook in the environment's site-packages, however it is started.
#  1. The image's ENV, for runtimes that drop it (ch-run without --set-env), and its bin/ on PATH
#     (a login shell's /etc/profile resets PATH).
#  2. Activation: every $prefix/etc/conda/activate.d/*.sh is sourced, as `conda activate` would
#     (conda-forge's libblas=*=*mkl sets MKL_INTERFACE_LAYER only there).
_imagefactory_prefix=/opt/env
case ":${PATH:-}:" in
    *:/opt/env/bin:/opt/conda/bin:*) ;;
    *) PATH=/opt/env/bin:/opt/conda/bin"${PATH:+:$PATH}"; export PATH ;;
esac
[ -n "${HF_HOME:-}" ] || export HF_HOME=/data/hf
[ -n "${MKL_NUM_THREADS:-}" ] || export MKL_NUM_THREADS=8
[ -n "${MKL_THREADING_LAYER:-}" ] || export MKL_THREADING_LAYER=INTEL
[ -n "${OMP_NUM_THREADS:-}" ] || export OMP_NUM_THREADS=8
[ -n "${OPENBLAS_NUM_THREADS:-}" ] || export OPENBLAS_NUM_THREADS=8
[ -n "${PIP_CERT:-}" ] || export PIP_CERT=/etc/ssl/certs/ca-certificates.crt
[ -n "${REQUESTS_CA_BUNDLE:-}" ] || export REQUESTS_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt
[ -n "${SSL_CERT_FILE:-}" ] || export SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt

if [ -d "$_imagefactory_prefix/etc/conda/activate.d" ]; then
    export CONDA_PREFIX="$_imagefactory_prefix"
    for _imagefactory_script in "$_imagefactory_prefix"/etc/conda/activate.d/*.sh; do
        # Activation scripts may print; stdout belongs to the command.
        # shellcheck disable=SC1090
        if [ -r "$_imagefactory_script" ]; then . "$_imagefactory_script" >&2; fi
    done
fi
unset _imagefactory_prefix _imagefactory_script
