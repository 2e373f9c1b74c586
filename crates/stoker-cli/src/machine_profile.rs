//! Where this machine's profile lives (`stoker plan --calibrate` writes it, every later
//! `stoker plan --config` and `stoker train` reads it): `$STOKER_PROFILE` where set (`off`
//! turns the profile off, as the test suite does), else
//! `$XDG_CONFIG_HOME/stoker/profile.toml`, else `~/.config/stoker/profile.toml`.

use std::path::PathBuf;

use anyhow::Context;
use stoker_train::machine::profile::MachineProfile;

/// The environment variable that names the profile's file, or `off`.
pub const PROFILE_ENV: &str = "STOKER_PROFILE";

/// The profile's file; None where `STOKER_PROFILE=off` (or no home directory is known).
pub fn path() -> Option<PathBuf> {
    if let Some(v) = std::env::var_os(PROFILE_ENV) {
        return match v.to_str() {
            Some("off" | "none" | "") => None,
            _ => Some(PathBuf::from(v)),
        };
    }
    let config = std::env::var_os("XDG_CONFIG_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".config")))?;
    Some(config.join("stoker").join("profile.toml"))
}

/// The profile, where there is one: Ok(None) where it is off or not written yet; an
/// unreadable file is an error naming it.
pub fn load() -> anyhow::Result<Option<MachineProfile>> {
    let Some(p) = path() else {
        return Ok(None);
    };
    MachineProfile::load(&p).with_context(|| {
        format!("reading this machine's profile ({PROFILE_ENV}=off plans without it)")
    })
}

/// The profile there where it is this machine's (this CPU, `cores` cores), for a
/// calibration to add to: Ok(None) where there is none; Err says what a new one replaces
/// (another machine's, or a file that does not read).
pub fn this_machines(cores: usize) -> Result<Option<MachineProfile>, String> {
    match load() {
        Ok(None) => Ok(None),
        Ok(Some(p)) => match p.other_machine(&stoker_train::machine::profile::this_cpu(), cores) {
            None => Ok(Some(p)),
            Some(why) => Err(why),
        },
        Err(e) => Err(crate::error_text::chain_text(&e)),
    }
}
