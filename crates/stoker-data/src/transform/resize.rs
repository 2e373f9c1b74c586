//! Resizing through fast_image_resize for the two pixel types stoker decodes: grey and RGB
//! bytes.
//!
//! `Resizer::resize` picks one of fast_image_resize's thirteen pixel types at run time, so
//! every call site compiles the convolutions of all thirteen into this crate (at the
//! workspace's own `opt-level`). Going through `Resizer::resize_typed` for `U8` and `U8x3`
//! alone runs the same code (`resize` is that match and that call) and compiles two of them.

use fast_image_resize::images::Image;
use fast_image_resize::pixels::{U8x3, U8};
use fast_image_resize::{
    ImageError, IntoImageView, IntoImageViewMut, PixelTrait, PixelType, ResizeError, ResizeOptions,
    Resizer,
};

/// Resizes `src` into `dst` (both grey or both RGB bytes), as `Resizer::resize` does.
pub(crate) fn resize_bytes(
    resizer: &mut Resizer,
    src: &impl IntoImageView,
    dst: &mut Image<'_>,
    options: &ResizeOptions,
) -> Result<(), ResizeError> {
    if src.pixel_type() != Some(dst.pixel_type()) {
        return Err(ResizeError::PixelTypesAreDifferent);
    }
    match src.pixel_type() {
        Some(PixelType::U8) => resize_as::<U8>(resizer, src, dst, options),
        Some(PixelType::U8x3) => resize_as::<U8x3>(resizer, src, dst, options),
        _ => Err(ImageError::UnsupportedPixelType.into()),
    }
}

/// `src` into `dst` as images of pixel type `P`.
fn resize_as<P: PixelTrait>(
    resizer: &mut Resizer,
    src: &impl IntoImageView,
    dst: &mut Image<'_>,
    options: &ResizeOptions,
) -> Result<(), ResizeError> {
    match (src.image_view::<P>(), dst.image_view_mut::<P>()) {
        (Some(src), Some(mut dst)) => resizer.resize_typed(&src, &mut dst, options),
        _ => Err(ResizeError::PixelTypesAreDifferent),
    }
}
