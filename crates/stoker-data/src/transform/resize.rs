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

#[cfg(test)]
mod tests {
    use super::*;
    use fast_image_resize::images::ImageRef;

    /// Grey 2x2 to 1x1, then the two refusals `Resizer::resize` would give too: another
    /// pixel type on one side, and one of the types stoker never decodes.
    #[test]
    fn grey_resizes_and_mixed_or_other_pixel_types_are_errors() {
        let mut resizer = Resizer::new();
        let opts = ResizeOptions::new();
        let grey = [10u8, 20, 30, 40];
        let src = ImageRef::new(2, 2, &grey, PixelType::U8).unwrap();
        let mut out = [0u8; 1];
        let mut dst = Image::from_slice_u8(1, 1, &mut out, PixelType::U8).unwrap();
        resize_bytes(&mut resizer, &src, &mut dst, &opts).unwrap();
        assert_eq!(out, [25]);

        let mut rgb = [0u8; 3];
        let mut dst = Image::from_slice_u8(1, 1, &mut rgb, PixelType::U8x3).unwrap();
        let err = resize_bytes(&mut resizer, &src, &mut dst, &opts).unwrap_err();
        assert!(matches!(err, ResizeError::PixelTypesAreDifferent), "{err}");

        let wide = [0u8; 8];
        let src = ImageRef::new(2, 2, &wide, PixelType::U16).unwrap();
        let mut out = [0u8; 2];
        let mut dst = Image::from_slice_u8(1, 1, &mut out, PixelType::U16).unwrap();
        let err = resize_bytes(&mut resizer, &src, &mut dst, &opts).unwrap_err();
        assert!(
            matches!(
                err,
                ResizeError::ImageError(ImageError::UnsupportedPixelType)
            ),
            "{err}"
        );
    }
}
