#!/usr/bin/env bash
# Rate against distortion of every codec of the leader's top-k positions on large models' gradients
# (lgc-bench codecs), with LGC's premise per layer beside it: every worker's gradients of short dense
# runs, 4 and 8 workers at 32 and 128 images per worker (IID), scored at densities 1 % and 0.1 %,
# chunks of 64, the rotating leader (LGC-RAR's and the shared-index codecs' default; LEADERS=fixed,rotating
# for both). LGC's autoencoder at the reference widths and at a quarter of them, in the leader's value
# order (its best in lgc-bench autoencoder), the PCA-initialised one, beside the scalar codecs.
#   * ResNet-50 (torchvision, the ImageNet stem) on Fashion-MNIST (28x28), 40 steps (PCA and the
#     autoencoders fitted on the first 20, the last 20 scored); seven layers from the stem to fc.
#   * The ResNet-50 PSPNet (dilated, output stride 8, bins 1/2/3/6) on Fashion scenes at 32x32 (garments
#     at 0.5-1x so that they fit), 20 steps (10 fitted, 10 scored); seven layers from the stem to the
#     classifier (the 18.9M-value head convolution is left out: every worker's gradients of every step
#     are held in memory).
# Writes OUT/resnet50/ and OUT/pspnet/ (codecs.md, codecs.json, codecs.png) after every codec measured, then
# the int8-latents pass into OUT/resnet50_int8_latents/ and OUT/pspnet_int8_latents/ (PASSES=main for one);
# the recordings are kept in RECORDINGS (default outputs/codecs_recordings, about 20 GB); a rerun reuses
# them and keeps every row measured before. Many CPU-hours on 2 cores: PSPNet's 8 x 128 recording and
# the reference autoencoder's training (1500 updates per recording, density) dominate.
#   experiments/codecs_large_models.sh [OUT]
#   MODELS=resnet50 experiments/codecs_large_models.sh
#   MODELS=resnet50 WORKERS=8 BATCH_SIZES=128 experiments/codecs_large_models.sh   (one recording; the others' results kept)
# Needs the dataset: apt-get install dataset-fashion-mnist (or FASHION_MNIST_ROOT).
set -euo pipefail
out=${1:-experiments/results/codecs_large}
# The main pass: every codec family (OUT/MODEL). The int8-latents pass (OUT/MODEL_int8_latents): LGC's
# autoencoders with int8 latents, in position and in value order, as LGC-RAR's latent_dtype=int8 sends
# them, beside the linear codec and the scalar codecs of their rates on the same recordings.
main=${CODECS:-fp32,fp16,int8,int4,levels=1,pca:4:fp32,pca:16:int8,pca:16:int8:value,ae:4:fp32:value,ae:4:fp32:value:w0.25,pcaae:16:fp32,leader_scaled,topk}
int8_latents=${LATENT_CODECS:-int8,int4,levels=1,pca:16:int8,pca:16:int8:value,ae:4:int8,ae:4:int8:value,pcaae:16:int8}
for pass in ${PASSES:-main int8_latents}; do
  case $pass in
    main) codecs=$main; suffix="" ;;
    int8_latents) codecs=$int8_latents; suffix=_int8_latents ;;
    *) echo "unknown pass $pass (main or int8_latents)" >&2; exit 2 ;;
  esac
  common=(--workers "${WORKERS:-4,8}" --batch-sizes "${BATCH_SIZES:-32,128}" --density 0.01,0.001 --chunk 64
    --codecs "$codecs" --leaders "${LEADERS:-rotating}" --keep-recordings "${RECORDINGS:-outputs/codecs_recordings}")
  for model in ${MODELS:-resnet50 pspnet}; do
    case $model in
      resnet50)
        lgc-bench codecs --data fashion_mnist --model resnet50 --override model.stem=imagenet --steps 40 \
          --patterns "model.conv1.weight,model.layer1.0.conv2.weight,model.layer2.0.conv2.weight,\
model.layer3.0.conv2.weight,model.layer4.0.conv2.weight,model.layer4.2.conv3.weight,model.fc.weight" \
          "${common[@]}" --out "$out/resnet50$suffix" ;;
      pspnet)
        lgc-bench codecs --data fashion_scenes --model pspnet --override data.size=32 --override "data.scale=[0.5,1.0]" \
          --steps 20 \
          --patterns "model.backbone.conv1.weight,model.backbone.layer1.0.conv2.weight,\
model.backbone.layer2.0.conv2.weight,model.backbone.layer3.0.conv2.weight,model.backbone.layer4.0.conv2.weight,\
model.ppm.stages.3.1.weight,model.head.4.weight" \
          "${common[@]}" --out "$out/pspnet$suffix" ;;
      *) echo "unknown model $model (resnet50 or pspnet)" >&2; exit 2 ;;
    esac
  done
done
