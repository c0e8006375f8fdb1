"""Image decoding and augmentation with tf.image's names and semantics, in NumPy.

Decoders read the header first (:func:`read_header`), so a decoded image can be
booked on the pipeline's budget before its pixels exist
(``Dataset.map(decode, ..., output_nbytes=decoded_nbytes)``) and a decompression
bomb is refused from its declared size (``max_pixels``); the pixels are
TensorFlow's, bit for bit (PNG of any depth and colour type, grey/RGB/CMYK JPEG,
BMP). Random operations are deterministic per element: inside a map, an int
``seed`` (``seed=42``, as tf.data users write it) is combined with the element's
position in the map's input and the epoch of each enclosing ``repeat``; anywhere,
``seed=(pipeline_seed, element_index)`` (``Dataset.enumerate()`` gives the index)
is the stateless pair itself. Either way the augmentation of an element is the
same whatever the number of workers, and again after a restore.
``headrace.tf_compat`` exposes them as ``tf.image.*`` and ``tf.io.decode_*``.

Needs the ``[image]`` extra (simplejpeg for JPEG, Pillow for PNG/GIF/BMP) for
decoding; everything else is NumPy.
"""

from headrace.image._codec import (
    MAX_PIXELS,
    ImageHeader,
    InvalidImageError,
    decode_and_crop_jpeg,
    decode_bmp,
    decode_gif,
    decode_image,
    decode_jpeg,
    decode_png,
    decoded_nbytes,
    extract_jpeg_shape,
    is_jpeg,
    read_header,
)
from headrace.image._more import (
    adjust_gamma,
    adjust_hue,
    adjust_saturation,
    grayscale_to_rgb,
    hsv_to_rgb,
    pad_to_bounding_box,
    random_hue,
    random_saturation,
    resize_with_crop_or_pad,
    resize_with_pad,
    rgb_to_grayscale,
    rgb_to_hsv,
    rot90,
    stateless_random_hue,
    stateless_random_saturation,
    total_variation,
    transpose,
)
from headrace.image._ops import (
    ResizeMethod,
    adjust_brightness,
    adjust_contrast,
    central_crop,
    convert_image_dtype,
    crop_to_bounding_box,
    flip_left_right,
    flip_up_down,
    normalize,
    per_image_standardization,
    resize,
)
from headrace.image._random import (
    InceptionCrop,
    random_brightness,
    random_contrast,
    random_crop,
    random_flip_left_right,
    random_flip_up_down,
    random_resized_crop,
    random_resized_crop_box,
    sample_distorted_bounding_box,
    stateless_random_brightness,
    stateless_random_contrast,
    stateless_random_crop,
    stateless_random_flip_left_right,
    stateless_random_flip_up_down,
    stateless_sample_distorted_bounding_box,
)

__all__ = [
    "MAX_PIXELS",
    "ImageHeader",
    "InceptionCrop",
    "InvalidImageError",
    "ResizeMethod",
    "adjust_brightness",
    "adjust_contrast",
    "adjust_gamma",
    "adjust_hue",
    "adjust_saturation",
    "central_crop",
    "convert_image_dtype",
    "crop_to_bounding_box",
    "decode_and_crop_jpeg",
    "decode_bmp",
    "decode_gif",
    "decode_image",
    "decode_jpeg",
    "decode_png",
    "decoded_nbytes",
    "extract_jpeg_shape",
    "flip_left_right",
    "flip_up_down",
    "grayscale_to_rgb",
    "hsv_to_rgb",
    "is_jpeg",
    "normalize",
    "pad_to_bounding_box",
    "per_image_standardization",
    "random_brightness",
    "random_contrast",
    "random_crop",
    "random_flip_left_right",
    "random_flip_up_down",
    "random_hue",
    "random_resized_crop",
    "random_resized_crop_box",
    "random_saturation",
    "read_header",
    "resize",
    "resize_with_crop_or_pad",
    "resize_with_pad",
    "rgb_to_grayscale",
    "rgb_to_hsv",
    "rot90",
    "sample_distorted_bounding_box",
    "stateless_random_brightness",
    "stateless_random_contrast",
    "stateless_random_crop",
    "stateless_random_flip_left_right",
    "stateless_random_flip_up_down",
    "stateless_random_hue",
    "stateless_random_saturation",
    "stateless_sample_distorted_bounding_box",
    "total_variation",
    "transpose",
]
