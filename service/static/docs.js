// Swagger UI over this service's own OpenAPI document (GET /schema). validatorUrl: null keeps it from
// sending the document to swagger.io's online validator: nothing leaves this host.
window.ui = SwaggerUIBundle({
  url: "/schema",
  dom_id: "#swagger-ui",
  deepLinking: true,
  validatorUrl: null,
  tryItOutEnabled: true,
  persistAuthorization: false,
  presets: [SwaggerUIBundle.presets.apis],
  layout: "BaseLayout",
});
