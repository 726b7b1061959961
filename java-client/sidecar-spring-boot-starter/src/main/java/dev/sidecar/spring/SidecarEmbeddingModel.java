package dev.sidecar.spring;

import dev.sidecar.client.SidecarClient;
import dev.sidecar.v1.EmbedRequest;
import dev.sidecar.v1.EmbedResponse;
import io.micrometer.observation.ObservationRegistry;
import java.util.ArrayList;
import java.util.List;
import org.springframework.ai.chat.metadata.DefaultUsage;
import org.springframework.ai.document.Document;
import org.springframework.ai.embedding.Embedding;
import org.springframework.ai.embedding.EmbeddingModel;
import org.springframework.ai.embedding.EmbeddingRequest;
import org.springframework.ai.embedding.EmbeddingResponse;
import org.springframework.ai.embedding.EmbeddingResponseMetadata;
import org.springframework.ai.embedding.observation.DefaultEmbeddingModelObservationConvention;
import org.springframework.ai.embedding.observation.EmbeddingModelObservationContext;
import org.springframework.ai.embedding.observation.EmbeddingModelObservationConvention;
import org.springframework.ai.embedding.observation.EmbeddingModelObservationDocumentation;

/**
 * Spring AI {@link EmbeddingModel} over the sidecar's Embed RPC (unit-length vectors).
 * Each {@link #call} is observed with Spring AI's embedding-model observation (one
 * observation even when the inputs are sent in several batches); failures are Spring AI's
 * Transient/NonTransientAiException with the client's typed exception as cause.
 */
public class SidecarEmbeddingModel implements EmbeddingModel {

    private static final EmbeddingModelObservationConvention DEFAULT_CONVENTION =
            new DefaultEmbeddingModelObservationConvention();

    /** The Embed RPC's per-call input limit; larger requests are sent in batches. */
    static final int MAX_INPUTS = 256;

    private final SidecarClient client;
    private final ObservationRegistry observationRegistry;
    private EmbeddingModelObservationConvention observationConvention;
    private volatile Integer dimensions;

    public SidecarEmbeddingModel(SidecarClient client) {
        this(client, ObservationRegistry.NOOP);
    }

    public SidecarEmbeddingModel(SidecarClient client, ObservationRegistry observationRegistry) {
        this.client = client;
        this.observationRegistry = observationRegistry == null ? ObservationRegistry.NOOP : observationRegistry;
    }

    /** Replaces the default embedding observation convention (null restores it). */
    public void setObservationConvention(EmbeddingModelObservationConvention convention) {
        this.observationConvention = convention;
    }

    @Override
    public EmbeddingResponse call(EmbeddingRequest request) {
        List<String> inputs = request.getInstructions();
        if (inputs.isEmpty()) {
            throw new IllegalArgumentException("inputs: at least one text is required");
        }
        EmbeddingModelObservationContext context = EmbeddingModelObservationContext.builder()
                .embeddingRequest(request).provider(SidecarChatModel.PROVIDER).build();
        return EmbeddingModelObservationDocumentation.EMBEDDING_MODEL_OPERATION
                .observation(observationConvention, DEFAULT_CONVENTION, () -> context, observationRegistry)
                .observe(() -> {
                    EmbeddingResponse response;
                    try {
                        response = embedAll(request, inputs);
                    } catch (RuntimeException e) {
                        throw SpringAiErrors.translate(e);
                    }
                    context.setResponse(response);
                    return response;
                });
    }

    private EmbeddingResponse embedAll(EmbeddingRequest request, List<String> inputs) {
        String model = request.getOptions() != null && request.getOptions().getModel() != null
                ? request.getOptions().getModel() : "";
        List<Embedding> embeddings = new ArrayList<>(inputs.size());
        int promptTokens = 0;
        String servedModel = model;
        for (int start = 0; start < inputs.size(); start += MAX_INPUTS) {
            List<String> batch = inputs.subList(start, Math.min(inputs.size(), start + MAX_INPUTS));
            EmbedResponse r = client.embed(EmbedRequest.newBuilder().addAllInputs(batch).setModel(model).build());
            for (int i = 0; i < r.getEmbeddingsCount(); i++) {
                List<Float> values = r.getEmbeddings(i).getValuesList();
                float[] v = new float[values.size()];
                for (int j = 0; j < v.length; j++) {
                    v[j] = values.get(j);
                }
                embeddings.add(new Embedding(v, start + i));
            }
            promptTokens += r.getPromptTokens();
            servedModel = r.getModel();
        }
        return new EmbeddingResponse(embeddings,
                new EmbeddingResponseMetadata(servedModel, new DefaultUsage(promptTokens, 0, promptTokens)));
    }

    @Override
    public float[] embed(Document document) {
        return embed(getEmbeddingContent(document));
    }

    /** From the sidecar's model info when it reports it, else by embedding a probe text. */
    @Override
    public int dimensions() {
        Integer d = dimensions;
        if (d == null) {
            int reported;
            try {
                reported = client.modelInfo().getEmbeddingDimensions();
            } catch (RuntimeException e) {
                throw SpringAiErrors.translate(e);
            }
            d = reported > 0 ? reported : EmbeddingModel.super.dimensions();
            dimensions = d;
        }
        return d;
    }
}
