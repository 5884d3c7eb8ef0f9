"""What predict.py reads, per input kind. The readers are the data side's own, so that an input
that cannot be read is a BadSample naming the file, as in training: images with
datasets.base.read_image, audio with datasets.audio.read_audio; text is read line by line by predict.py."""
from datasets.audio import EXTENSIONS as AUDIO_EXTENSIONS  # noqa: F401  (re-exported)
from datasets.base import read_image  # noqa: F401  (re-exported)

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp")
