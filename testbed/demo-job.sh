#!/bin/bash
#SBATCH --job-name=hpcdl-demo --nodes=2 --ntasks-per-node=1 --gres=gpu:2 --time=10
export PATH=@VENV@/bin:$PATH TF_CPP_MIN_LOG_LEVEL=2
echo "-- one task per node, each in the container (hpcdl/base), with the GPUs Slurm gave it"
srun hpcdl-containers run -e CUDA_VISIBLE_DEVICES -e SLURMD_NODENAME hpcdl/base:latest -- python3 -m jupyter_hpcdl.diagnose
echo "-- the same tasks as Horovod ranks joined over Gloo (allreduce of rank+1 over all ranks)"
hpcdl-launch --image hpcdl/base:latest -e TF_CPP_MIN_LOG_LEVEL -- python3 -m jupyter_hpcdl.diagnose --allreduce
