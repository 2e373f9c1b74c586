//! Helpers shared by the planner's tests.
#![allow(dead_code)]

use stoker_plan::input::PlanInput;
use stoker_plan::resolve::{resolve, Resolved};
use stoker_plan::{Plan, PlanError};

/// Resolves a TOML plan input given as text.
pub fn resolved(toml_text: &str) -> Result<Resolved, PlanError> {
    let input = PlanInput::from_toml_str("test.toml", toml_text)?;
    resolve(&PlanInput::default(), None, &input)
}

/// Plans a TOML plan input given as text; panics (in tests) on input errors.
pub fn plan(toml_text: &str) -> Plan {
    stoker_plan::plan(resolved(toml_text).expect("valid input"), None)
}

/// Label of the chosen strategy.
pub fn chosen(p: &Plan) -> Option<&str> {
    p.decision.chosen.map(|i| p.strategies[i].label.as_str())
}

/// Rounds to one decimal.
pub fn r1(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}

/// Rounds to two decimals.
pub fn r2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}
